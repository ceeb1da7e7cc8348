//! Peers killed mid-transfer. Prefill and decode instances run as separate `pdserve serve`
//! processes on 127.0.0.1; requests go to the decode instance the way pdserve's proxy sends
//! them (`kv_transfer_params` naming the prefill instance). Prompts are long and prefill runs
//! them in small chunks, so a hand-off is in flight for a while; one side is SIGKILLed then.
//! The affected requests must end with a clear error, the survivor's block pool must return
//! to full, and the survivor must keep serving.

mod common;

use common::free_tcp_port;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "synthetic:small,context=4096";

/// A `pdserve serve` child, killed when dropped.
struct Node {
    child: Child,
    url: String,
    port: u16,
}

impl Node {
    fn start(role: &str, name: &str, mode: &str) -> Self {
        Self::start_logging(role, name, mode, None)
    }

    /// With `log`: JSON log lines at info level go to that file.
    fn start_logging(role: &str, name: &str, mode: &str, log: Option<&std::path::Path>) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
        if let Some(path) = log {
            cmd.args(["--log-format", "json", "--log", "info"])
                .env("PDSERVE_LOGGING__FILTER", "info")
                .stderr(std::fs::File::create(path).unwrap());
        } else {
            cmd.env("PDSERVE_LOGGING__FILTER", "error")
                .stderr(Stdio::inherit());
        }
        Self::spawn(cmd, role, name, mode)
    }

    /// Errors only, with stderr (the stop line included) going to `err`.
    fn start_capturing(role: &str, name: &str, mode: &str, err: &std::path::Path) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
        cmd.env("PDSERVE_LOGGING__FILTER", "error")
            .stderr(std::fs::File::create(err).unwrap());
        Self::spawn(cmd, role, name, mode)
    }

    fn spawn(mut cmd: Command, role: &str, name: &str, mode: &str) -> Self {
        let port = free_tcp_port();
        let child = cmd
            .args([
                "serve",
                "--role",
                role,
                "--name",
                name,
                "--model",
                MODEL,
                "--port",
                &port.to_string(),
                "--transfer",
                "tcp",
                "--transfer-mode",
                mode,
                "--max-num-batched-tokens",
                "32",
                "--max-num-seqs",
                "32",
                "--threads",
                "1",
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            port,
        }
    }

    async fn ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(pdserve_actors::http::http_client().build().unwrap().get(format!("{}/health", self.url)).send().await, Ok(r) if r.status() == 200)
        {
            assert!(
                Instant::now() < deadline,
                "{} never became healthy",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn load(&self) -> Value {
        pdserve_actors::http::http_client()
            .build()
            .unwrap()
            .get(format!("{}/v1/load", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until nothing is queued or running and every block is free.
    async fn assert_pool_full(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = self.load().await;
            if l["blocks_free"] == l["blocks_total"] && l["running"] == 0 && l["waiting"] == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} pool not back to full: {l}",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the instance runs something.
    async fn busy(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.load().await["running"].as_u64().unwrap_or(0) == 0 {
            assert!(
                Instant::now() < deadline,
                "{} never started the prefill",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

fn request(prompt_tokens: usize, prefill_port: Option<u16>) -> Value {
    let prompt: Vec<u32> = (0..prompt_tokens)
        .map(|t| ((t * 31 + 3) % 250) as u32)
        .collect();
    let mut b = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    if let Some(port) = prefill_port {
        b["kv_transfer_params"] =
            json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port});
    }
    b
}

async fn post(url: &str, body: Value) -> Result<(u16, Value), String> {
    let r = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}/v1/completions"))
        .timeout(Duration::from_secs(60))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let v = r.json().await.map_err(|e| e.to_string())?;
    Ok((status, v))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_decode_instance_killed_mid_push_leaves_prefill_clean_and_serving() {
    runtime().block_on(async {
        let p = Node::start("prefill", "kill-d-p", "push");
        let mut d = Node::start("decode", "kill-d-d", "push");
        p.ready().await;
        d.ready().await;
        let pending: Vec<_> = (0..3)
            .map(|i| {
                let (url, port) = (d.url.clone(), p.port);
                tokio::spawn(async move { post(&url, request(2500 + 100 * i, Some(port))).await })
            })
            .collect();
        p.busy().await;
        d.kill();
        for h in pending {
            let r = h.await.unwrap();
            assert!(
                !matches!(r, Ok((200, _))),
                "a request whose decode instance died cannot succeed: {r:?}"
            );
        }
        p.assert_pool_full().await;
        // The prefill instance still serves, with a new decode instance.
        let d2 = Node::start("decode", "kill-d-d2", "push");
        d2.ready().await;
        let (status, v) = post(&d2.url, request(300, Some(p.port))).await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 8);
        p.assert_pool_full().await;
        d2.assert_pool_full().await;
    });
}

#[test]
fn a_prefill_instance_killed_mid_transfer_fails_its_requests_clearly() {
    runtime().block_on(async {
        for mode in ["push", "pull"] {
            let mut p = Node::start("prefill", &format!("kill-p-p-{mode}"), mode);
            let d = Node::start("decode", &format!("kill-p-d-{mode}"), mode);
            p.ready().await;
            d.ready().await;
            let started = Instant::now();
            let pending: Vec<_> = (0..3)
                .map(|i| {
                    let (url, port) = (d.url.clone(), p.port);
                    tokio::spawn(
                        async move { post(&url, request(2500 + 100 * i, Some(port))).await },
                    )
                })
                .collect();
            p.busy().await;
            p.kill();
            for h in pending {
                let (status, v) = h.await.unwrap().expect("decode answers");
                assert_eq!(status, 502, "{mode}: {v}");
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(msg.contains("prefill"), "{mode}: {msg}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(45),
                "{mode}: failures must be timely"
            );
            d.assert_pool_full().await;
            // The decode instance still serves (prefilling itself).
            let (status, v) = post(&d.url, request(100, None)).await.unwrap();
            assert_eq!(status, 200, "{mode}: {v}");
            d.assert_pool_full().await;
        }
    });
}

/// The transfer ids in a file of JSON log lines.
fn transfer_ids(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            v["fields"]["transfer"]
                .as_str()
                .or(v["span"]["transfer"].as_str())
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn one_transfer_id_traces_a_request_through_proxy_prefill_and_decode() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let log = |n: &str| dir.path().join(format!("{n}.log"));
        let p = Node::start_logging("prefill", "trace-p", "push", Some(&log("prefill")));
        let d = Node::start_logging("decode", "trace-d", "push", Some(&log("decode")));
        p.ready().await;
        d.ready().await;
        let port = free_tcp_port();
        let proxy = Node {
            child: Command::new(env!("CARGO_BIN_EXE_pdserve"))
                .args(["--log-format", "json", "--log", "info", "proxy", "--port"])
                .arg(port.to_string())
                .args(["--prefill", &p.url, "--decode", &d.url])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(log("proxy")).unwrap())
                .spawn()
                .unwrap(),
            url: format!("http://127.0.0.1:{port}"),
            port,
        };
        proxy.ready().await;
        let (status, v) = post(&proxy.url, request(40, None)).await.unwrap();
        assert_eq!(status, 200, "{v}");
        let routed = transfer_ids(&log("proxy"));
        assert_eq!(routed.len(), 1, "one routing line: {routed:?}");
        let id = &routed[0];
        assert_eq!(id.len(), 32, "{id}");
        // Log lines reach the file as they are written; allow the last ones a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (pl, dl) = (transfer_ids(&log("prefill")), transfer_ids(&log("decode")));
            if pl.contains(id) && dl.contains(id) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "transfer {id} missing: prefill {pl:?}, decode {dl:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// The instance's last stderr line of its phased shutdown (`pdserve: stopped ...`).
fn stop_line(path: &std::path::Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .find(|l| l.starts_with("pdserve: stopped"))
        .unwrap_or_else(|| panic!("no stop line in {}", path.display()))
        .to_string()
}

/// `KV blocks F/T free` of a stop line, as (F, T).
fn stopped_pool(line: &str) -> (u64, u64) {
    let rest = line.split("KV blocks ").nth(1).expect(line);
    let (free, rest) = rest.split_once('/').expect(line);
    let total = rest.split_whitespace().next().expect(line);
    (free.parse().expect(line), total.parse().expect(line))
}

/// SIGTERM on an instance stops it in phases: it stops admitting, drains what runs, then
/// stops. A decode instance SIGTERMed while 8 disaggregated requests are in flight finishes
/// them (or ends each with a clear error), exits 0 with its pool full and no task left; the
/// prefill instance is left with a full pool and stops as cleanly.
#[test]
fn sigterm_during_eight_in_flight_hand_offs_drains_cleanly() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        for mode in ["pull", "push"] {
            let err = |n: &str| dir.path().join(format!("{n}-{mode}.err"));
            let mut p =
                Node::start_capturing("prefill", &format!("term-p-{mode}"), mode, &err("p"));
            let mut d = Node::start_capturing("decode", &format!("term-d-{mode}"), mode, &err("d"));
            p.ready().await;
            d.ready().await;
            let pending: Vec<_> = (0..8)
                .map(|i| {
                    let (url, port) = (d.url.clone(), p.port);
                    tokio::spawn(async move { post(&url, request(400 + 40 * i, Some(port))).await })
                })
                .collect();
            p.busy().await;
            let status = tokio::task::block_in_place(|| common::sigterm_and_wait(&mut d.child));
            assert!(status.success(), "{mode}: decode exited with {status}");
            let (mut finished, mut failed) = (0, 0);
            for h in pending {
                match h.await.unwrap() {
                    Ok((200, v)) => {
                        assert_eq!(v["usage"]["completion_tokens"], 8, "{mode}: {v}");
                        finished += 1;
                    }
                    Ok((status, v)) => {
                        let msg = v["error"]["message"].as_str().unwrap_or("");
                        assert!(status >= 500 && !msg.is_empty(), "{mode}: {status} {v}");
                        failed += 1;
                    }
                    Err(e) => panic!("{mode}: a request got no answer: {e}"),
                }
            }
            println!("{mode}: {finished} finished, {failed} failed with a clear error");
            let line = stop_line(&err("d"));
            let (free, total) = stopped_pool(&line);
            assert!(
                total > 0 && free == total,
                "{mode}: decode stopped with {line}"
            );
            assert!(line.contains("no task left"), "{mode}: {line}");
            p.assert_pool_full().await;
            let status = tokio::task::block_in_place(|| common::sigterm_and_wait(&mut p.child));
            assert!(status.success(), "{mode}: prefill exited with {status}");
            let line = stop_line(&err("p"));
            let (free, total) = stopped_pool(&line);
            assert!(free == total, "{mode}: prefill stopped with {line}");
            assert!(line.contains("no task left"), "{mode}: {line}");
        }
    });
}
