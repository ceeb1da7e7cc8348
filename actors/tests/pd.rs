//! Prefill/decode disaggregation between two in-process instances, driven the way a vLLM P/D
//! proxy drives them: the prefill instance gets the request with `max_tokens: 1`,
//! `stream: false` and `kv_transfer_params.do_remote_decode`; the decode instance gets the
//! original request with the `kv_transfer_params` the prefill answer returned, reads the KV
//! through the transfer engine and decodes from the prefill side's first token. Under greedy
//! sampling the tokens must equal a colocated instance's.

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn model(spec: &str) -> pdserve_gpu::loader::LoadedModel {
    load_model(&ModelSource::Synthetic(spec.into())).unwrap()
}

async fn instance(
    name: &str,
    spec: &str,
    tp: usize,
    transfer: Option<BackendKind>,
    lease: Duration,
) -> Instance {
    let mut o = InstanceOptions::local(name, model(spec));
    o.tp = tp;
    o.kv_lease = lease;
    o.transfer = transfer.map(|b| {
        let mut c = TransferConfig::new(b, name);
        if b == BackendKind::Quic {
            // Both members of a pair must come from one cluster CA (a stranger is refused).
            static CLUSTER: std::sync::OnceLock<
                pdserve_transport::control::tls::ClusterCredentials,
            > = std::sync::OnceLock::new();
            let cluster = CLUSTER.get_or_init(|| {
                pdserve_transport::control::tls::ClusterCredentials::ephemeral("pd-test").unwrap()
            });
            c.credentials = Some(cluster.issue(name).unwrap());
        }
        c
    });
    Instance::start(o).await.unwrap()
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (
        status,
        serde_json::from_str(&r.text().await.unwrap()).unwrap(),
    )
}

async fn assert_pool_full(inst: &Instance) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = inst.stats().await.unwrap();
        if s.blocks_free == s.blocks_total && s.running == 0 && s.waiting == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} pool not back to full: {s:?}",
            inst.model_name()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn body(i: usize) -> Value {
    let prompt: Vec<u32> = (0..(6 + 9 * i))
        .map(|t| ((t * 37 + i * 11 + 5) % 250) as u32)
        .collect();
    json!({"prompt": prompt, "max_tokens": 12 + i, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The proxy's two hops; returns the decode side's answer.
async fn via_pd(prefill: &str, decode: &str, original: &Value) -> (u16, Value) {
    let mut p = original.clone();
    p["max_tokens"] = json!(1);
    p["stream"] = json!(false);
    p["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, answer) = post(prefill, &p).await;
    assert_eq!(status, 200, "prefill: {answer}");
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    let mut d = original.clone();
    d["kv_transfer_params"] = params;
    post(decode, &d).await
}

async fn colocated_reference(spec: &str, n: usize) -> Vec<Vec<u64>> {
    // Actor names are process-wide and tests run in parallel: one name per call.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let c = instance(
        &format!("ref-{spec}-{call}"),
        spec,
        1,
        None,
        Duration::from_secs(30),
    )
    .await;
    let mut out = Vec::new();
    for i in 0..n {
        let (status, v) = post(&c.url(), &body(i)).await;
        assert_eq!(status, 200, "{v}");
        out.push(ids(&v));
    }
    c.stop().await;
    out
}

async fn check_pair(
    spec: &str,
    backend: BackendKind,
    tp_p: usize,
    tp_d: usize,
    reference: &[Vec<u64>],
) {
    let tag = format!("{backend:?}-{tp_p}-{tp_d}-{spec}")
        .to_lowercase()
        .replace([',', '='], "_");
    let p = instance(
        &format!("p-{tag}"),
        spec,
        tp_p,
        Some(backend),
        Duration::from_secs(30),
    )
    .await;
    let d = instance(
        &format!("d-{tag}"),
        spec,
        tp_d,
        Some(backend),
        Duration::from_secs(30),
    )
    .await;
    let handles: Vec<_> = (0..reference.len())
        .map(|i| {
            let (pu, du) = (p.url(), d.url());
            tokio::spawn(async move { via_pd(&pu, &du, &body(i)).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{tag} request {i}: {v}");
        assert_eq!(ids(&v), reference[i], "{tag} request {i}");
    }
    assert_pool_full(&p).await;
    assert_pool_full(&d).await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_mode_matches_colocated_on_every_backend() {
    let reference = colocated_reference("small", 8).await;
    for backend in [
        BackendKind::Local,
        BackendKind::Shm,
        BackendKind::Tcp,
        BackendKind::Quic,
    ] {
        check_pair("small", backend, 1, 1, &reference).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_tp_maps_head_ranges() {
    let reference = colocated_reference("small", 4).await;
    check_pair("small", BackendKind::Tcp, 1, 2, &reference).await;
    check_pair("small", BackendKind::Tcp, 2, 1, &reference).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hand_offs_fail_clearly_and_free_their_blocks() {
    let p = instance(
        "p-bad",
        "small",
        1,
        Some(BackendKind::Tcp),
        Duration::from_millis(300),
    )
    .await;
    let d = instance(
        "d-bad",
        "small",
        1,
        Some(BackendKind::Tcp),
        Duration::from_secs(30),
    )
    .await;
    let other = instance(
        "d-other",
        "small,layers=3",
        1,
        Some(BackendKind::Tcp),
        Duration::from_secs(30),
    )
    .await;
    let mut first = body(2);
    first["max_tokens"] = json!(1);
    first["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, answer) = post(&p.url(), &first).await;
    assert_eq!(status, 200, "{answer}");
    let params = answer["kv_transfer_params"].clone();

    // Forged block ids: one more than the prompt needs, and one outside the pool.
    for forged in [json!([0, 1, 2, 3, 4, 5]), json!([0, 99999, 1])] {
        let mut d_body = body(2);
        let mut p2 = params.clone();
        p2["remote_block_ids"] = forged;
        d_body["kv_transfer_params"] = p2;
        let (status, v) = post(&d.url(), &d_body).await;
        assert_eq!(status, 502, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("block"),
            "{v}"
        );
    }
    // A decode instance of another model shape refuses the peer at the handshake.
    let mut d_body = body(2);
    d_body["kv_transfer_params"] = params.clone();
    let (status, v) = post(&other.url(), &d_body).await;
    assert_eq!(status, 502, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("incompatible"),
        "{v}"
    );

    // The lease runs out before decode reads: the late read fails loudly.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, v) = post(&d.url(), &d_body).await;
    assert_eq!(status, 502, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("expired"),
        "{v}"
    );

    for inst in [&p, &d, &other] {
        assert_pool_full(inst).await;
    }
    // Everyone still serves.
    let (status, v) = via_pd(&p.url(), &d.url(), &body(1)).await;
    assert_eq!(status, 200, "{v}");
    for inst in [p, d, other] {
        inst.stop().await;
    }
}

async fn wait_healthy(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(r) = reqwest::get(format!("{url}/health")).await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "proxy never became healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sse_token_ids(body: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut done = false;
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .trim()
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("bad event {event:?}"));
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(ids) = v["choices"][0]["token_ids"].as_array() {
            out.extend(ids.iter().map(|t| t.as_u64().unwrap()));
        }
    }
    assert!(done, "stream must end with [DONE]");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_streams_disaggregated_answers_equal_to_colocated() {
    use pdserve_actors::proxy::{start_proxy, ProxyArgs};
    let reference = colocated_reference("small", 6).await;
    let p = instance(
        "p-proxy",
        "small",
        1,
        Some(BackendKind::Shm),
        Duration::from_secs(30),
    )
    .await;
    let d = instance(
        "d-proxy",
        "small",
        1,
        Some(BackendKind::Shm),
        Duration::from_secs(30),
    )
    .await;
    let args = ProxyArgs {
        bind: "127.0.0.1:0".parse().unwrap(),
        prefill: vec![p.url()],
        decode: vec![d.url()],
        timeout: Duration::from_secs(30),
    };
    let (proxy, addr, _join) = start_proxy("proxy-test", args).await.unwrap();
    let url = format!("http://{addr}");
    wait_healthy(&url).await;
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut b = body(i);
                let stream = i % 2 == 1;
                b["stream"] = json!(stream);
                let r = reqwest::Client::new()
                    .post(format!("{url}/v1/completions"))
                    .json(&b)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let ctype = r.headers()["content-type"].to_str().unwrap().to_string();
                let text = r.text().await.unwrap();
                if stream {
                    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
                    sse_token_ids(&text)
                } else {
                    ids(&serde_json::from_str(&text).unwrap())
                }
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await.unwrap(), reference[i], "request {i}");
    }
    // Bad input is refused at the door.
    let (status, v) = post(&url, &json!({"prompt": "x", "max_tokens": -1})).await;
    assert_eq!(status, 400, "{v}");
    assert_pool_full(&p).await;
    assert_pool_full(&d).await;
    proxy.stop(None);
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_without_a_prefill_instance_answers_503() {
    use pdserve_actors::proxy::{start_proxy, ProxyArgs};
    let d = instance(
        "d-lonely",
        "tiny",
        1,
        Some(BackendKind::Tcp),
        Duration::from_secs(30),
    )
    .await;
    let args = ProxyArgs {
        bind: "127.0.0.1:0".parse().unwrap(),
        prefill: vec![],
        decode: vec![d.url()],
        timeout: Duration::from_secs(5),
    };
    let (proxy, addr, _join) = start_proxy("proxy-503", args).await.unwrap();
    let (status, v) = post(
        &format!("http://{addr}"),
        &json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no prefill instance"),
        "{v}"
    );
    proxy.stop(None);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_disaggregated_tokens_equal_colocated() {
    let load = || load_model(&ModelSource::Default).unwrap();
    let start = |name: &str, transfer: Option<BackendKind>| {
        let mut o = InstanceOptions::local(name, load());
        o.num_blocks = Some(128);
        o.transfer = transfer.map(|b| TransferConfig::new(b, name));
        Instance::start(o)
    };
    let prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def add(a, b):",
        "List three colors:",
        "Once upon a time, in a small village by the mountains, there lived",
        "1, 2, 3, 4,",
        "Q: What is the boiling point of water? A:",
        "The quick brown fox",
    ];
    let req = |p: &str, n: usize| json!({"prompt": p, "max_tokens": 8 + n, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let c = start("ref-default", None).await.unwrap();
    let mut reference = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (status, v) = post(&c.url(), &req(p, i)).await;
        assert_eq!(status, 200, "{v}");
        reference.push(ids(&v));
    }
    c.stop().await;
    let p = start("p-default", Some(BackendKind::Shm)).await.unwrap();
    let d = start("d-default", Some(BackendKind::Shm)).await.unwrap();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let (pu, du, b) = (p.url(), d.url(), req(prompt, i));
            tokio::spawn(async move { via_pd(&pu, &du, &b).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(ids(&v), reference[i], "prompt {:?}", prompts[i]);
    }
    assert_pool_full(&p).await;
    assert_pool_full(&d).await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_instance_fails_the_read_clearly_and_decode_keeps_serving() {
    let p = instance(
        "p-dies",
        "small",
        1,
        Some(BackendKind::Tcp),
        Duration::from_secs(30),
    )
    .await;
    let d = instance(
        "d-survives",
        "small",
        1,
        Some(BackendKind::Tcp),
        Duration::from_secs(30),
    )
    .await;
    let mut first = body(1);
    first["max_tokens"] = json!(1);
    first["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, answer) = post(&p.url(), &first).await;
    assert_eq!(status, 200, "{answer}");
    // The prefill instance dies after answering, before decode reads its KV.
    p.stop().await;
    let mut second = body(1);
    second["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    let started = Instant::now();
    let (status, v) = post(&d.url(), &second).await;
    assert_eq!(status, 502, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("KV"),
        "{v}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the failure must be timely"
    );
    assert_pool_full(&d).await;
    // The survivor still serves plain requests.
    let (status, v) = post(&d.url(), &body(0)).await;
    assert_eq!(status, 200, "{v}");
    d.stop().await;
}
