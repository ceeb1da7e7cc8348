//! A "multi-host" deployment started from one file: every node is a separate process on
//! 127.0.0.1 with its own port, started as `pdserve serve --config FILE --node NAME`.

mod common;

use common::{free_port, Procs};
use std::process::Command;
use std::time::{Duration, Instant};

/// `pdserve serve --config FILE --node NODE`.
fn node_cmd(file: &std::path::Path, node: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    cmd.args(["serve", "--config"])
        .arg(file)
        .args(["--node", node]);
    cmd
}

/// Nodes start in any order, as pods do: one instance before the proxy, two after it. The
/// proxy polls the instances it was configured with until each answers.
#[test]
fn nodes_started_from_one_file_serve_through_the_proxy() {
    let (proxy, prefill, d0, d1) = (free_port(), free_port(), free_port(), free_port());
    let file = tempfile::NamedTempFile::new().unwrap();
    common::write_deployment(
        file.path(),
        "test",
        "synthetic:tiny",
        None,
        proxy,
        &[
            ("prefill-0", "prefill", prefill),
            ("decode-0", "decode", d0),
            ("decode-1", "decode", d1),
        ],
    );
    let mut procs = Procs::new();
    for node in ["decode-1", "proxy", "prefill-0", "decode-0"] {
        procs.spawn(node, &mut node_cmd(file.path(), node));
    }
    let url = format!("http://127.0.0.1:{proxy}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = pdserve_actors::http::http_client().build().unwrap();
        // Liveness bound: healthy takes about a second; 60 s only catches a cluster that
        // never forms. A node that exits fails the test at once, with its log.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            procs.assert_running();
            let v = get_json(&client, &format!("{url}/health")).await;
            if v["prefill"] == 1 && v["decode"] == 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "deployment never became healthy (last /health: {v}); the nodes' logs follow"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..4 {
            let r = client
                .post(format!("{url}/v1/completions"))
                .timeout(Duration::from_secs(60))
                .json(&serde_json::json!({"prompt": format!("request {i}"), "max_tokens": 5, "ignore_eos": true}))
                .send()
                .await
                .unwrap();
            let status = r.status();
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["usage"]["completion_tokens"], 5);
        }
    });
    procs.assert_running();
    // A file that is a deployment needs --node.
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["serve", "--config", file.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--node"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node whose address is taken does not wait for a cluster it cannot join: it exits
/// non-zero and names the address. HTTP ports of the proxy and of an instance (TCP), and the
/// proxy's control port (UDP), each taken by another socket in turn.
#[test]
fn a_node_whose_port_is_taken_exits_naming_the_address() {
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("credentials");
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["cluster", "init"])
        .arg(&creds)
        .args(["--name", "taken", "--node", "proxy", "--node", "prefill-0"])
        .args(["--node", "decode-0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (proxy, prefill, decode, control) = (free_port(), free_port(), free_port(), free_port());
    let file = dir.path().join("cluster.toml");
    common::write_deployment(
        &file,
        "taken",
        "synthetic:tiny",
        Some((&creds, control)),
        proxy,
        &[
            ("prefill-0", "prefill", prefill),
            ("decode-0", "decode", decode),
        ],
    );
    for (node, port, udp) in [
        ("proxy", proxy, false),
        ("prefill-0", prefill, false),
        ("proxy", control, true),
    ] {
        let _tcp = (!udp).then(|| std::net::TcpListener::bind(("127.0.0.1", port)).unwrap());
        let _udp = udp.then(|| std::net::UdpSocket::bind(("127.0.0.1", port)).unwrap());
        let mut procs = Procs::new();
        let child = procs.spawn(node, &mut node_cmd(&file, node));
        // Liveness bound: the bind fails at start, well within a second; 60 s only catches a
        // node that keeps running (or hangs) with its port taken.
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{node} kept running with 127.0.0.1:{port} ({}) taken",
                if udp { "UDP" } else { "TCP" }
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = procs.log(node);
        assert!(
            !status.success(),
            "{node} exited {status} with its port taken:\n{log}"
        );
        assert!(
            log.contains(&format!("127.0.0.1:{port}")),
            "{node}'s error does not name 127.0.0.1:{port}:\n{log}"
        );
    }
}

/// GET `url` as JSON (bounded), or `Null` when it does not answer.
async fn get_json(client: &reqwest::Client, url: &str) -> serde_json::Value {
    match client.get(url).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    }
}

/// A streamed completion of `body` through `url`, on `rt`: its whole raw answer (or why it
/// failed), and a signal sent once its first token has arrived.
fn stream(
    rt: &tokio::runtime::Runtime,
    client: &reqwest::Client,
    url: &str,
    b: serde_json::Value,
) -> (
    tokio::task::JoinHandle<Result<String, String>>,
    tokio::sync::oneshot::Receiver<()>,
) {
    let (client, url) = (client.clone(), url.to_string());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let h = rt.spawn(async move {
        let mut r = client
            .post(format!("{url}/v1/completions"))
            .json(&b)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let mut raw = String::new();
        let mut tx = Some(tx);
        loop {
            match r.chunk().await {
                Ok(Some(c)) => {
                    raw.push_str(&String::from_utf8_lossy(&c));
                    if raw.contains("\"text\"") {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(());
                        }
                    }
                }
                Ok(None) => return Ok(raw),
                Err(e) => return Err(e.to_string()),
            }
        }
    });
    (h, rx)
}

/// Waits (bounded) until `url`'s pool is full and nothing runs, waits or is held.
async fn pool_full(procs: &mut Procs, client: &reqwest::Client, url: &str) {
    // Liveness bound: blocks come back within a second or two; 30 s only catches a leak.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        procs.assert_running();
        let l = get_json(client, &format!("{url}/v1/load")).await;
        if l["blocks_free"] == l["blocks_total"]
            && l["running"] == 0
            && l["waiting"] == 0
            && l["held"] == 0
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{url}: pool not back to full: {l}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until the proxy at `url` routes to one prefill and one decode instance.
async fn proxy_ready(procs: &mut Procs, client: &reqwest::Client, url: &str) {
    // Liveness bound: registration takes a second or two (reconnects back off to 2 s); 60 s
    // only catches instances that never register.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        procs.assert_running();
        let v = get_json(client, &format!("{url}/health")).await;
        if v["prefill"] == 1 && v["decode"] == 1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never became ready (last /health: {v}); the nodes' logs follow"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn a_killed_proxy_fails_its_streams_clearly_and_its_restart_gets_every_instance_back() {
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("credentials");
    let name = format!("restart-{}", std::process::id());
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["cluster", "init"])
        .arg(&creds)
        .args(["--name", &name, "--node", "proxy", "--node", "prefill-0"])
        .args(["--node", "decode-0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (proxy, prefill, decode, control) = (free_port(), free_port(), free_port(), free_port());
    let file = dir.path().join("cluster.toml");
    common::write_deployment(
        &file,
        &name,
        "synthetic:tiny",
        Some((&creds, control)),
        proxy,
        &[
            ("prefill-0", "prefill", prefill),
            ("decode-0", "decode", decode),
        ],
    );
    let start = |procs: &mut Procs, node: &str| {
        procs.spawn(
            node,
            node_cmd(&file, node).env("PDSERVE_LOGGING__FILTER", "warn"),
        );
    };
    // The instances start before the proxy: they keep trying to register until it is up.
    let mut procs = Procs::new();
    for node in ["prefill-0", "decode-0", "proxy"] {
        start(&mut procs, node);
    }
    let url = format!("http://127.0.0.1:{proxy}");
    let instances = [
        format!("http://127.0.0.1:{prefill}"),
        format!("http://127.0.0.1:{decode}"),
    ];
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = pdserve_actors::http::http_client().build().unwrap();
    let body = |stream: bool| {
        serde_json::json!({"prompt": "a proxy restart", "max_tokens": 400, "temperature": 0,
                           "ignore_eos": true, "stream": stream})
    };
    let reference = rt.block_on(async {
        proxy_ready(&mut procs, &client, &url).await;
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    });

    // Four streams run through the proxy; it is SIGKILLed once each has its first tokens.
    let streams: Vec<_> = (0..4)
        .map(|_| stream(&rt, &client, &url, body(true)))
        .collect();
    let mut handles = Vec::new();
    for (h, rx) in streams {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), rx)
                .await
                .expect("a stream produced no token")
                .expect("a stream ended before its first token");
        });
        handles.push(h);
    }
    // Stopped, decode-0 (where every stream's tokens come from) sends nothing more: no
    // stream can finish before the proxy dies, however fast the machine.
    common::signal(procs.child("decode-0"), libc::SIGSTOP);
    procs.kill("proxy");
    common::signal(procs.child("decode-0"), libc::SIGCONT);
    for h in handles {
        match rt.block_on(h).unwrap() {
            Err(e) => eprintln!("stream through the killed proxy: {e}"),
            Ok(raw) => assert!(
                !raw.contains("[DONE]"),
                "a stream through a killed proxy looked complete: {raw}"
            ),
        }
    }
    // The instances saw their caller go: both pools return to full, nothing held.
    rt.block_on(async {
        for i in &instances {
            pool_full(&mut procs, &client, i).await;
        }
    });

    // The proxy comes back on the same addresses: both instances register again on their
    // own, and it serves the same greedy text.
    procs.assert_running();
    start(&mut procs, "proxy");
    rt.block_on(async {
        proxy_ready(&mut procs, &client, &url).await;
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), reference);
        for i in &instances {
            pool_full(&mut procs, &client, i).await;
        }
    });
}

/// A proxy asked to stop (SIGTERM) drains: `/health` answers 503 `draining` at once, so load
/// balancers send clients to another proxy, and the stream it carries finishes complete
/// before it exits 0.
#[test]
fn a_stopping_proxy_answers_draining_and_finishes_its_stream_before_it_exits() {
    let (proxy, prefill, decode) = (free_port(), free_port(), free_port());
    let file = tempfile::NamedTempFile::new().unwrap();
    common::write_deployment(
        file.path(),
        "drain",
        "synthetic:tiny",
        None,
        proxy,
        &[
            ("prefill-0", "prefill", prefill),
            ("decode-0", "decode", decode),
        ],
    );
    let mut procs = Procs::new();
    for node in ["prefill-0", "decode-0", "proxy"] {
        procs.spawn(
            node,
            node_cmd(file.path(), node).env("PDSERVE_LOGGING__FILTER", "warn"),
        );
    }
    let url = format!("http://127.0.0.1:{proxy}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = pdserve_actors::http::http_client().build().unwrap();
    rt.block_on(proxy_ready(&mut procs, &client, &url));
    // A stream through the proxy, held mid-way: once it has its first token the decode
    // instance is stopped (SIGSTOP). On a fast machine the stream may already have ended by
    // then; then it is resumed and another is tried (5 at most).
    let mut held = None;
    for attempt in 0..5 {
        let body = serde_json::json!({"prompt": format!("a draining proxy {attempt}"),
                                      "max_tokens": 1000, "temperature": 0,
                                      "ignore_eos": true, "stream": true});
        let (stream, rx) = stream(&rt, &client, &url, body);
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), rx)
                .await
                .expect("the stream produced no token")
                .expect("the stream ended before its first token");
        });
        common::signal(procs.child("decode-0"), libc::SIGSTOP);
        // Whatever was already sent reaches the client within this; a stream that ended
        // before the stop has ended by then.
        std::thread::sleep(Duration::from_millis(300));
        if !stream.is_finished() {
            held = Some(stream);
            break;
        }
        common::signal(procs.child("decode-0"), libc::SIGCONT);
        rt.block_on(stream).unwrap().expect("the stream failed");
    }
    let stream = held.expect("every stream ended before the decode instance was stopped");
    common::signal(procs.stopping("proxy"), libc::SIGTERM);
    rt.block_on(async {
        // Liveness bound: the proxy marks itself draining within a poll or two.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = client
                .get(format!("{url}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .unwrap();
            let status = r.status();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            if v["draining"] == true {
                assert_eq!(status, 503, "{v}");
                assert_eq!(v["status"], "draining", "{v}");
                break;
            }
            assert!(Instant::now() < deadline, "never draining: {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert!(
        procs.child("proxy").try_wait().unwrap().is_none(),
        "the proxy exited with a stream in flight"
    );
    common::signal(procs.child("decode-0"), libc::SIGCONT);
    let raw = rt.block_on(stream).unwrap().expect("the stream failed");
    assert!(raw.contains("[DONE]"), "the stream was cut: {raw}");
    // Nothing left in flight: it exits by itself (liveness bound 30 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = procs.child("proxy").try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the drained proxy did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "the proxy exited with {status}");
}
