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
    std::fs::write(
        file.path(),
        format!(
            r#"
[cluster]
name = "test"
model = "synthetic:tiny"
transport = "tcp"

[[node]]
name = "proxy"
role = "proxy"
host = "127.0.0.1"
port = {proxy}

[[node]]
name = "prefill-0"
role = "prefill"
host = "127.0.0.1"
port = {prefill}
threads = 1

[[node]]
name = "decode-0"
role = "decode"
host = "127.0.0.1"
port = {d0}
threads = 1

[[node]]
name = "decode-1"
role = "decode"
host = "127.0.0.1"
port = {d1}
threads = 1
"#
        ),
    )
    .unwrap();
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
