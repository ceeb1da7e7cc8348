//! Peers killed mid-transfer. Prefill and decode instances run as separate `pdserve serve`
//! processes on 127.0.0.1; requests go to the decode instance the way pdserve's proxy sends
//! them (`kv_transfer_params` naming the prefill instance). Prompts are long and prefill runs
//! them in small chunks, so a hand-off is in flight for a while; one side is SIGKILLed then.
//! The affected requests must end with a clear error, the survivor's block pool must return
//! to full, and the survivor must keep serving.

mod common;

use common::{free_port, Procs};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};

const MODEL: &str = "synthetic:small,context=4096";

/// Liveness bound on one request: a few seconds normally, a failed hand-off included; a
/// request still unanswered after this hangs (it is not a speed requirement).
const REQUEST_BOUND: Duration = Duration::from_secs(120);

/// A `pdserve serve` child, its stdout and stderr in its own log file (printed when the test
/// fails); stopped when dropped.
struct Node {
    procs: Procs,
    name: String,
    url: String,
    port: u16,
}

impl Node {
    /// Warnings and errors in the log.
    fn start(role: &str, name: &str, mode: &str) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
        cmd.env("PDSERVE_LOGGING__FILTER", "warn");
        Self::spawn(cmd, role, name, mode)
    }

    /// JSON log lines at info level in the log ([`Node::log_path`]).
    fn start_logging(role: &str, name: &str, mode: &str) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
        cmd.args(["--log-format", "json", "--log", "info"])
            .env("PDSERVE_LOGGING__FILTER", "info");
        Self::spawn(cmd, role, name, mode)
    }

    fn spawn(mut cmd: Command, role: &str, name: &str, mode: &str) -> Self {
        let port = free_port();
        cmd.args([
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
        ]);
        Self::with(name, cmd, port)
    }

    /// Runs `cmd` as the node `name` that serves HTTP on `port`.
    fn with(name: &str, mut cmd: Command, port: u16) -> Self {
        let mut procs = Procs::new();
        procs.spawn(name, &mut cmd);
        Self {
            procs,
            name: name.to_string(),
            url: format!("http://127.0.0.1:{port}"),
            port,
        }
    }

    /// Its log file (stdout and stderr).
    fn log_path(&self) -> std::path::PathBuf {
        self.procs.log_path(&self.name)
    }

    /// Its process, to be stopped by the test.
    fn stopping(&mut self) -> &mut std::process::Child {
        self.procs.stopping(&self.name)
    }

    async fn ready(&mut self) {
        // Liveness bound: an instance is up in about a second; 60 s only catches one that
        // never starts (one that exits fails at once, with its log).
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(pdserve_actors::http::http_client().build().unwrap().get(format!("{}/health", self.url)).timeout(Duration::from_secs(5)).send().await, Ok(r) if r.status() == 200)
        {
            self.procs.assert_running();
            assert!(
                Instant::now() < deadline,
                "{} never became healthy",
                self.url
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn kill(&mut self) {
        self.procs.kill(&self.name);
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
        .timeout(REQUEST_BOUND)
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
        let mut p = Node::start("prefill", "kill-d-p", "push");
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
        let mut d2 = Node::start("decode", "kill-d-d2", "push");
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
            let mut d = Node::start("decode", &format!("kill-p-d-{mode}"), mode);
            p.ready().await;
            d.ready().await;
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
                // Within REQUEST_BOUND: a dead prefill peer must end its requests, not hang
                // them.
                let (status, v) = h
                    .await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{mode}: decode never answered: {e}"));
                assert_eq!(status, 502, "{mode}: {v}");
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(msg.contains("prefill"), "{mode}: {msg}");
            }
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
        let mut p = Node::start_logging("prefill", "trace-p", "push");
        let mut d = Node::start_logging("decode", "trace-d", "push");
        p.ready().await;
        d.ready().await;
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
        cmd.args(["--log-format", "json", "--log", "info", "proxy", "--port"])
            .arg(port.to_string())
            .args(["--prefill", &p.url, "--decode", &d.url]);
        let mut proxy = Node::with("trace-proxy", cmd, port);
        proxy.ready().await;
        let (status, v) = post(&proxy.url, request(40, None)).await.unwrap();
        assert_eq!(status, 200, "{v}");
        let routed = transfer_ids(&proxy.log_path());
        assert_eq!(routed.len(), 1, "one routing line: {routed:?}");
        let id = &routed[0];
        assert_eq!(id.len(), 32, "{id}");
        // Log lines reach the file as they are written; allow the last ones a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (pl, dl) = (transfer_ids(&p.log_path()), transfer_ids(&d.log_path()));
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
        for mode in ["pull", "push"] {
            let mut p = Node::start("prefill", &format!("term-p-{mode}"), mode);
            let mut d = Node::start("decode", &format!("term-d-{mode}"), mode);
            p.ready().await;
            d.ready().await;
            let pending: Vec<_> = (0..8)
                .map(|i| {
                    let (url, port) = (d.url.clone(), p.port);
                    tokio::spawn(async move { post(&url, request(400 + 40 * i, Some(port))).await })
                })
                .collect();
            p.busy().await;
            let status = tokio::task::block_in_place(|| common::sigterm_and_wait(d.stopping()));
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
            let line = stop_line(&d.log_path());
            let (free, total) = stopped_pool(&line);
            assert!(
                total > 0 && free == total,
                "{mode}: decode stopped with {line}"
            );
            assert!(line.contains("no task left"), "{mode}: {line}");
            p.assert_pool_full().await;
            let status = tokio::task::block_in_place(|| common::sigterm_and_wait(p.stopping()));
            assert!(status.success(), "{mode}: prefill exited with {status}");
            let line = stop_line(&p.log_path());
            let (free, total) = stopped_pool(&line);
            assert!(free == total, "{mode}: prefill stopped with {line}");
            assert!(line.contains("no task left"), "{mode}: {line}");
        }
    });
}
