//! A "multi-host" deployment started from one file: every node is a separate process on
//! 127.0.0.1 with its own port, started as `pdserve serve --config FILE --node NAME`.

mod common;

use common::free_tcp_port;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Nodes(Vec<Child>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // SAFETY: signalling our own children.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGTERM);
            }
        }
        for c in &mut self.0 {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn nodes_started_from_one_file_serve_through_the_proxy() {
    let (proxy, prefill, d0, d1) = (
        free_tcp_port(),
        free_tcp_port(),
        free_tcp_port(),
        free_tcp_port(),
    );
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
    let mut nodes = Nodes(Vec::new());
    for node in ["prefill-0", "decode-0", "decode-1", "proxy"] {
        let child = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args([
                "serve",
                "--config",
                file.path().to_str().unwrap(),
                "--node",
                node,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        nodes.0.push(child);
    }
    let url = format!("http://127.0.0.1:{proxy}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = pdserve_actors::http::http_client().build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = client.get(format!("{url}/health")).send().await {
                let v: serde_json::Value = r.json().await.unwrap_or_default();
                if v["prefill"] == 1 && v["decode"] == 2 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "deployment never became healthy");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for i in 0..4 {
            let r = client
                .post(format!("{url}/v1/completions"))
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

/// GET `url` as JSON (bounded), or `Null` when it does not answer.
async fn get_json(client: &reqwest::Client, url: &str) -> serde_json::Value {
    match client.get(url).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    }
}

/// Waits (bounded) until `url`'s pool is full and nothing runs, waits or is held.
async fn pool_full(client: &reqwest::Client, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
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
async fn proxy_ready(client: &reqwest::Client, url: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let v = get_json(client, &format!("{url}/health")).await;
        if v["prefill"] == 1 && v["decode"] == 1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never became ready: {v}"
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
    let (proxy, prefill, decode) = (free_tcp_port(), free_tcp_port(), free_tcp_port());
    let control = common::free_udp_port();
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
    let start = |node: &str| {
        Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["serve", "--config"])
            .arg(&file)
            .args(["--node", node])
            .env("PDSERVE_LOGGING__FILTER", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut nodes = Nodes(vec![start("prefill-0"), start("decode-0"), start("proxy")]);
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
        proxy_ready(&client, &url, Duration::from_secs(60)).await;
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
        .map(|_| {
            let (client, url, b) = (client.clone(), url.clone(), body(true));
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
        })
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
    let proxy_child = nodes.0.pop().unwrap();
    let mut proxy_child = proxy_child;
    proxy_child.kill().unwrap();
    proxy_child.wait().unwrap();
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
            pool_full(&client, i).await;
        }
    });

    // The proxy comes back on the same addresses: both instances register again on their
    // own, and it serves the same greedy text.
    nodes.0.push(start("proxy"));
    rt.block_on(async {
        proxy_ready(&client, &url, Duration::from_secs(30)).await;
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
            pool_full(&client, i).await;
        }
    });
}
