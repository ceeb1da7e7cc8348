//! Admission control and load shedding: past an instance's or the proxy's bound on requests
//! in flight, or a server's bound on open connections, a request is answered `503` with
//! `Retry-After` at once — never queued without bound, never left hanging — and a client
//! that does not finish its header is cut off. Pools are full afterwards.

mod common;
use common::assert_pool_full;

use pdserve_actors::http::ConnLimits;
use pdserve_actors::proxy::{start_proxy, ProxyArgs};
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on any one request of these tests: far past what any takes; only a hang reaches it.
const HANG: Duration = Duration::from_secs(60);

async fn start(name: &str, tweak: impl FnOnce(&mut InstanceOptions)) -> Instance {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic("tiny".into())).unwrap(),
    );
    tweak(&mut o);
    Instance::start(o).await.unwrap()
}

fn client() -> reqwest::Client {
    pdserve_actors::http::http_client().build().unwrap()
}

/// A request's outcome: status, `Retry-After`, body.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
    took: Duration,
}

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> Answer {
    let t0 = Instant::now();
    let r = tokio::time::timeout(HANG, async {
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let retry_after = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = r.text().await.unwrap();
        (status, retry_after, text)
    })
    .await
    .expect("a request hung");
    Answer {
        status: r.0,
        retry_after: r.1,
        body: serde_json::from_str(&r.2).unwrap_or(Value::String(r.2)),
        took: t0.elapsed(),
    }
}

/// A fake upstream: answers `GET /v1/load` as an idle instance would, and holds every POST
/// (counted) until released, then answers it 500.
struct Fake {
    url: String,
    port: u16,
    posts: tokio::sync::watch::Receiver<usize>,
    release: tokio::sync::watch::Sender<bool>,
}

async fn fake() -> Fake {
    use axum::routing::get;
    let (count, posts) = tokio::sync::watch::channel(0usize);
    let (release, released) = tokio::sync::watch::channel(false);
    let count = std::sync::Arc::new(count);
    let app = axum::Router::new()
        .route(
            "/v1/load",
            get(|| async { axum::Json(json!({"waiting": 0, "running": 0, "blocks_free": 100})) }),
        )
        .fallback(move || {
            let mut released = released.clone();
            count.send_modify(|n| *n += 1);
            async move {
                let _ = released.wait_for(|r| *r).await;
                (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "released")
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Fake {
        url: format!("http://127.0.0.1:{port}"),
        port,
        posts,
        release,
    }
}

impl Fake {
    /// Waits until `n` POSTs arrived (bounded by [`HANG`]).
    async fn wait_posts(&mut self, n: usize) {
        tokio::time::timeout(HANG, self.posts.wait_for(|&p| p >= n))
            .await
            .expect("the requests never reached the fake upstream")
            .unwrap();
    }
}

/// `n` requests sent at once, `body(i)` the i-th: their answers, in order.
async fn burst(
    c: &reqwest::Client,
    url: &str,
    n: usize,
    body: impl Fn(usize) -> Value,
) -> Vec<Answer> {
    let sent: Vec<_> = (0..n)
        .map(|i| {
            let (c, url, body) = (c.clone(), url.to_string(), body(i));
            tokio::spawn(async move { post(&c, &url, &body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for h in sent {
        answers.push(h.await.unwrap());
    }
    answers
}

fn assert_shed(a: &Answer, what: &str) {
    assert_eq!(a.status, 503, "{what}: {}", a.body);
    assert_eq!(a.retry_after.as_deref(), Some("1"), "{what}: Retry-After");
    let msg = a.body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("overloaded"), "{what}: {msg}");
}

/// Shed counter of `/metrics` for `reason` (0 when absent).
async fn shed_count(client: &reqwest::Client, url: &str, reason: &str) -> f64 {
    let text = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let key = format!("pdserve_requests_shed_total{{reason=\"{reason}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A burst of 10× the instance's bound while every slot is taken (by requests whose prefill
/// peer never answers): all 40 get 503 with `Retry-After` at once, none waits for a slot.
/// With the slots free again, a second burst gets full answers or 503s — at least as many
/// answers as slots — and nothing hangs. The pool is full after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_burst_on_an_instance_is_shed_with_503() {
    const SLOTS: usize = 4;
    let inst = start("d-burst", |o| {
        o.max_concurrent_requests = SLOTS;
        o.transfer = Some(TransferConfig::new(BackendKind::Local, "d-burst"));
        o.min_remote_prompt_tokens = 0;
        o.kv_timeout = 2 * HANG;
    })
    .await;
    let url = inst.url();
    let c = client();
    let shed_before = shed_count(&c, &url, "requests").await;
    // One silent prefill peer per held request (a peer's handshake is shared).
    let mut peers = Vec::new();
    let mut held = Vec::new();
    for i in 0..SLOTS {
        let mut peer = fake().await;
        let body = json!({"prompt": format!("hold {i}"), "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.1",
                "remote_port": peer.port,
                "transfer_id": pdserve_runtime::ids::TransferId::new_random().to_string()}});
        let (c, url) = (c.clone(), url.clone());
        held.push(tokio::spawn(async move { post(&c, &url, &body).await }));
        peer.wait_posts(1).await;
        peers.push(peer);
    }
    let mut slowest = Duration::ZERO;
    for a in burst(
        &c,
        &url,
        10 * SLOTS,
        |i| json!({"prompt": format!("burst {i}"), "max_tokens": 4}),
    )
    .await
    {
        assert_shed(&a, "burst with every slot held");
        slowest = slowest.max(a.took);
    }
    eprintln!(
        "{} refusals, the slowest answered in {slowest:?}",
        10 * SLOTS
    );
    let shed = shed_count(&c, &url, "requests").await - shed_before;
    assert!(
        shed >= (10 * SLOTS) as f64,
        "pdserve_requests_shed_total grew by {shed}"
    );
    // The silent peers give up: the held requests end with an error, their slots free.
    for p in &peers {
        p.release.send_replace(true);
    }
    for h in held {
        let a = h.await.unwrap();
        assert!(
            a.status >= 500 && a.status != 503,
            "a held request: {} {}",
            a.status,
            a.body
        );
    }
    assert_pool_full(&inst).await;

    // Slots free: every request is answered in full or refused, at least SLOTS in full.
    let (mut answered, mut slowest) = (0, Duration::ZERO);
    let body = |i| json!({"prompt": format!("burst {i}"), "max_tokens": 4, "ignore_eos": true});
    for a in burst(&c, &url, 10 * SLOTS, body).await {
        if a.status == 200 {
            assert_eq!(a.body["usage"]["completion_tokens"], 4, "{}", a.body);
            answered += 1;
        } else {
            assert_shed(&a, "burst with free slots");
            slowest = slowest.max(a.took);
        }
    }
    eprintln!("{answered} answered in full, the slowest refusal took {slowest:?}");
    assert!(answered >= SLOTS, "{answered} answered");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// The proxy sheds past `proxy.max_concurrent_requests` before anything goes upstream: with
/// its slots held by requests its (fake) instances never answer, a burst of 10× the bound is
/// refused at once and reaches no instance; once the instances answer, the slots free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overload_burst_at_the_proxy_is_shed_before_the_instances() {
    const SLOTS: usize = 2;
    // The decode instance is where a request goes (it drives the hand-off).
    let (prefill, mut up) = (fake().await, fake().await);
    let mut args = ProxyArgs::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![prefill.url.clone()],
        vec![up.url.clone()],
    );
    args.max_concurrent_requests = SLOTS;
    args.migration_limit = 0;
    args.prefill_retry = pdserve_runtime::config::PrefillRetry::Fail;
    let proxy = start_proxy("proxy-shed", args).await.unwrap();
    let url = format!("http://{}", proxy.addr);
    let c = client();
    // Routable once the proxy has polled the instances.
    let deadline = Instant::now() + HANG;
    while c
        .get(format!("{url}/health"))
        .send()
        .await
        .unwrap()
        .status()
        != 200
    {
        assert!(
            Instant::now() < deadline,
            "the proxy never saw its instances"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut held = Vec::new();
    for i in 0..SLOTS {
        let (c, url) = (c.clone(), url.clone());
        held.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &json!({"prompt": format!("hold {i}"), "max_tokens": 2}),
            )
            .await
        }));
    }
    up.wait_posts(SLOTS).await;
    for a in burst(
        &c,
        &url,
        10 * SLOTS,
        |i| json!({"prompt": format!("b{i}"), "max_tokens": 2}),
    )
    .await
    {
        assert_shed(&a, "proxy burst");
        assert!(a.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at the proxy"));
    }
    assert_eq!(*up.posts.borrow(), SLOTS, "the burst reached an instance");
    assert_eq!(*prefill.posts.borrow(), 0);
    // The instances answer (with an error): the held requests end and their slots free.
    up.release.send_replace(true);
    for h in held {
        let a = h.await.unwrap();
        assert!(
            a.status >= 500 && a.status != 503,
            "{} {}",
            a.status,
            a.body
        );
    }
    let a = post(&c, &url, &json!({"prompt": "again", "max_tokens": 2})).await;
    assert_eq!(
        *up.posts.borrow(),
        SLOTS + 1,
        "admitted and forwarded: {}",
        a.body
    );
    proxy.stop().await;
}

/// Past `server.max_connections` a connection is answered 503 with `Retry-After` and closed;
/// a client that trickles its header is cut off after `server.header_read_timeout_s`, and
/// its connection slot serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_and_slow_headers_are_cut_off() {
    const CAP: usize = 4;
    let inst = start("conns", |o| {
        o.conn_limits = ConnLimits {
            max_connections: CAP,
            header_read_timeout: Duration::from_secs(1),
        }
    })
    .await;
    let url = inst.url();
    let addr = url.trim_start_matches("http://").to_string();
    // CAP clients that trickle a header: one byte every 100 ms, never the blank line.
    let mut slow = Vec::new();
    for _ in 0..CAP {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    // Every slot is taken (the server has accepted all of them once a fresh connection is
    // refused): a new client gets 503 with Retry-After, not a hang.
    // No idle connections kept: each request is one connection, closed after it.
    let c = pdserve_actors::http::http_client()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let deadline = Instant::now() + HANG;
    let refused = loop {
        let a = post(&c, &url, &json!({"prompt": "x", "max_tokens": 2})).await;
        if a.status == 503 {
            break a;
        }
        // Accepted before the last slow client was: the cap is not reached yet.
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_shed(&refused, "over the connection cap");
    assert!(refused.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("connections"));
    // The trickling clients are cut off by the header timeout.
    let trickle = slow.into_iter().map(|mut s| {
        tokio::spawn(async move {
            let t0 = Instant::now();
            let mut buf = [0u8; 1024];
            loop {
                assert!(t0.elapsed() < HANG, "a slow header was never cut off");
                if s.write_all(b"x").await.is_err() {
                    return;
                }
                match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    Ok(Ok(_)) | Err(_) => {}
                }
            }
        })
    });
    for t in trickle.collect::<Vec<_>>() {
        t.await.unwrap();
    }
    // Their slots serve again.
    let deadline = Instant::now() + HANG;
    loop {
        let a = post(&c, &url, &json!({"prompt": "x", "max_tokens": 2})).await;
        if a.status == 200 {
            break;
        }
        assert_shed(&a, "while the cut-off connections are released");
        assert!(Instant::now() < deadline, "the slots never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        shed_count(&c, &url, "connections").await >= 1.0,
        "the refused connection is counted"
    );
    assert_pool_full(&inst).await;
    inst.stop().await;
}
