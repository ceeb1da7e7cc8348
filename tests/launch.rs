//! `pdserve launch` end to end: start a single-node 1P1D cluster, serve one streamed chat
//! request through its proxy, stop it with SIGTERM, and find no process left behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Processes whose environment carries `tag` (children inherit the launcher's environment).
fn tagged_processes(tag: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(entry.path().join("environ")) {
            if env.split(|&b| b == 0).any(|kv| kv == tag.as_bytes()) {
                pids.push(pid);
            }
        }
    }
    pids
}

#[test]
fn launch_serves_a_streamed_chat_and_stops_cleanly_on_sigterm() {
    let tag = format!("PDSERVE_TEST_LAUNCH_TAG={}", std::process::id());
    let (key, value) = tag.split_once('=').unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args([
            "launch",
            "--model",
            "synthetic:tiny",
            "--port",
            "0",
            "--threads",
            "1",
        ])
        .env(key, value)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // The proxy URL arrives on a line of its own.
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    let url = lines.next().expect("launcher printed nothing").unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    assert!(
        tagged_processes(&tag).len() >= 4,
        "launcher + prefill + decode + proxy"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        r.text().await.unwrap()
    });
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(
        events.last().map(|e| e.trim()),
        Some("data: [DONE]"),
        "{body}"
    );
    let finish = events
        .iter()
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
        .filter_map(|v| {
            v["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        })
        .next_back();
    assert_eq!(finish.as_deref(), Some("length"));

    // SIGTERM: everything stops, in bounded time, leaving nothing behind.
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(launcher.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "launcher did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tagged_processes(&tag).is_empty() {
        assert!(
            Instant::now() < deadline,
            "processes left behind: {:?}",
            tagged_processes(&tag)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
