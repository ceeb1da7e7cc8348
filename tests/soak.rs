//! The soak test of the reliability suite: a bounded stream of mixed requests — streamed and
//! not, aborted by the client, malformed — against a 1P2D cluster started by `pdserve launch`
//! while faults are injected into every instance (`[faults]` through `PDSERVE_FAULTS__*`,
//! which the launcher's children inherit): failed, delayed and corrupted KV transfer batches;
//! dropped, delayed and corrupted control messages; one panic per instance of the round's
//! chosen actor (`faults.actor_panic_target`: a TpWorker in round 1, the KvReceiver in round
//! 2 — decode instances only take its messages in pull mode — and the KvSender in round 3,
//! which only prefill instances use in push mode).
//!
//! At the end: every successful answer is token-identical to a colocated reference under
//! greedy sampling, every failed one carried a clear error, every block pool is full with no
//! hand-off in flight, no actor is left failed (each instance whose chosen actor takes
//! messages shows exactly its one injected restart of it in `pdserve inspect --json`, which
//! also lists every actor of every instance, the others none), and after SIGTERM no process
//! is left behind. Three rounds, alternating push and pull, each with its own fault seed; a
//! fourth (its own test) also SIGKILLs a whole instance process each minute of its run (and
//! once 3 s in), which the launcher restarts: the same invariants hold.

mod common;

use common::{assert_none_left, inspect};
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "synthetic:small";
/// Requests per round.
const REQUESTS: usize = 48;
/// Requests in flight at once.
const CONCURRENCY: usize = 4;
/// Distinct prompts (the reference is computed once per prompt).
const PROMPTS: usize = 8;

/// The faults of a round, as the instances' environment.
fn fault_env(seed: u64, panic_target: &str) -> Vec<(String, String)> {
    [
        // Per batch: a pushed request writes one batch per layer and chunk (~30 here), a
        // pulled one reads one batch per rank.
        ("FAULTS__TRANSFER_FAIL", "0.003"),
        ("FAULTS__TRANSFER_CORRUPT", "0.003"),
        ("FAULTS__TRANSFER_DELAY", "0.02"),
        ("FAULTS__TRANSFER_DELAY_MS", "20"),
        // Per message: the remote prefill call, renewals, releases, aborts, heartbeats.
        ("FAULTS__CONTROL_DROP", "0.02"),
        ("FAULTS__CONTROL_CORRUPT", "0.02"),
        ("FAULTS__CONTROL_DELAY", "0.05"),
        ("FAULTS__CONTROL_DELAY_MS", "30"),
        ("FAULTS__ACTOR_PANIC", "1.0"),
        ("FAULTS__ACTOR_PANIC_MAX", "1"),
        ("FAULTS__ACTOR_PANIC_TARGET", panic_target),
        ("FAULTS__SEED", &seed.to_string()),
        // Bounds that keep a lost message cheap in a test: a dropped call waits these out.
        ("TRANSFER__TIMEOUT_S", "3"),
        ("TRANSFER__KV_LEASE_S", "5"),
        ("SERVER__REQUEST_TIMEOUT_S", "10"),
        ("LOGGING__FILTER", "error"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("PDSERVE_{k}"), v.to_string()))
    .collect()
}

fn prompt(i: usize) -> Vec<u32> {
    let k = i % PROMPTS;
    let n = 12 + 37 * k;
    (0..n)
        .map(|t| ((t * 29 + k * 7 + 3) % 250) as u32)
        .collect()
}

fn max_tokens(i: usize) -> usize {
    6 + (i % PROMPTS) * 2
}

/// Greedy tokens of every prompt from a colocated instance without faults.
async fn reference() -> Vec<Vec<u64>> {
    let model = load_model(&ModelSource::Synthetic(
        MODEL.trim_start_matches("synthetic:").into(),
    ))
    .unwrap();
    // Actor names are per process, and the soak's tests run side by side.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let name = format!(
        "soak-reference-{}",
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let inst = Instance::start(InstanceOptions::local(&name, model))
        .await
        .unwrap();
    let mut out = Vec::new();
    for i in 0..PROMPTS {
        let (status, v) = post(&inst.url(), &body(i, false)).await;
        assert_eq!(status, 200, "{v}");
        out.push(token_ids(&v));
    }
    inst.stop().await;
    out
}

fn body(i: usize, stream: bool) -> Value {
    json!({"prompt": prompt(i), "max_tokens": max_tokens(i), "temperature": 0,
           "ignore_eos": true, "return_token_ids": true, "stream": stream})
}

fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// How one request ended.
#[derive(Debug)]
enum Outcome {
    Ok(usize, Vec<u64>),
    /// A clear error: status and message.
    Failed(u16, String),
    Rejected,
    Aborted,
}

/// A bad request body of kind `k`: malformed JSON, a negative `max_tokens`, a prompt longer
/// than the context, an unknown model.
fn bad_body(k: usize) -> String {
    let bodies = [
        "{not json".to_string(),
        json!({"prompt": "x", "max_tokens": -1}).to_string(),
        json!({"prompt": vec![1u32; 5000], "max_tokens": 4}).to_string(),
        json!({"prompt": "x", "max_tokens": 4, "model": "no-such-model"}).to_string(),
    ];
    bodies[k % bodies.len()].clone()
}

async fn one(url: String, i: usize) -> Outcome {
    let client = pdserve_actors::http::http_client().build().unwrap();
    match i % 8 {
        7 => {
            let r = client
                .post(format!("{url}/v1/completions"))
                .header("content-type", "application/json")
                .body(bad_body(i / 8))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status == 400 {
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .is_some_and(|m| !m.is_empty()),
                    "{v}"
                );
                Outcome::Rejected
            } else {
                // The model-name check happens on the decode instance: also a clear 4xx.
                Outcome::Failed(status, v.to_string())
            }
        }
        6 => {
            // The client leaves mid-request.
            let send = client
                .post(format!("{url}/v1/completions"))
                .json(&body(i, true))
                .send();
            let _ =
                tokio::time::timeout(Duration::from_millis(30 + 10 * (i as u64 % 5)), send).await;
            Outcome::Aborted
        }
        _ if i % 2 == 0 => {
            let r = client
                .post(format!("{url}/v1/completions"))
                .json(&body(i, true))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let text = r.text().await.unwrap_or_default();
            if status != 200 {
                return Outcome::Failed(status, text);
            }
            let mut ids = Vec::new();
            for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
                let data = event.trim().trim_start_matches("data: ");
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).unwrap();
                if let Some(e) = v.get("error") {
                    return Outcome::Failed(200, e.to_string());
                }
                if let Some(t) = v["choices"][0]["token_ids"].as_array() {
                    ids.extend(t.iter().map(|t| t.as_u64().unwrap()));
                }
            }
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            Outcome::Ok(i, ids)
        }
        _ => {
            let (status, v) = post(&url, &body(i, false)).await;
            if status == 200 {
                Outcome::Ok(i, token_ids(&v))
            } else {
                Outcome::Failed(status, v.to_string())
            }
        }
    }
}

/// Stops the launcher however the test ends.
struct Launcher(Child);

impl Drop for Launcher {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cluster_json(addr: &str, dir: &str) -> Value {
    let (ok, out, err) = inspect(&[addr, "--credentials-dir", dir, "--json"]);
    assert!(ok, "inspect failed: {err}");
    serde_json::from_str(&out).unwrap()
}

/// The actor each round panics once per instance, and the roles whose instances use it.
fn panic_target(round: u64) -> (&'static str, &'static [&'static str]) {
    match round {
        1 => ("TpWorker", &["prefill", "decode"]),
        2 => ("KvReceiver", &["decode"]),
        _ => ("KvSender", &["prefill"]),
    }
}

/// Nodes killed in turn by a round with kills.
const KILL_ORDER: [&str; 3] = ["decode-0", "prefill-0", "decode-1"];
/// Most kills in one round.
const MAX_KILLS: usize = 3;

/// The pid of the process serving `name` among those carrying `tag`.
fn pid_of(tag: &str, name: &str) -> Option<u32> {
    let needle = format!("--name\0{name}\0");
    common::tagged_processes(tag).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
    })
}

/// One round. With `kill_every`, a whole instance process is SIGKILLed (the launcher
/// restarts it) after 3 s and then once per `kill_every` while the load runs, in turn
/// decode-0, prefill-0, decode-1, at most [`MAX_KILLS`] times.
fn round(
    rt: &tokio::runtime::Runtime,
    round: u64,
    mode: &str,
    reference: &[Vec<u64>],
    kill_every: Option<Duration>,
) {
    let (target, used_by) = panic_target(round);
    let tag = format!("PDSERVE_TEST_SOAK_TAG={}-{round}", std::process::id());
    let (key, value) = tag.split_once('=').unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdserve"));
    cmd.args([
        "launch",
        "--model",
        MODEL,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--transport",
        "tcp",
        "--mode",
        mode,
        "--port",
        "0",
        "--threads",
        "1",
    ])
    .env(key, value)
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in fault_env(round, target) {
        cmd.env(k, v);
    }
    let mut launcher = Launcher(cmd.spawn().unwrap());
    let mut lines = BufReader::new(launcher.0.stdout.take().unwrap()).lines();
    let url = lines.next().expect("launcher printed nothing").unwrap();
    let line = lines.next().expect("no inspect line").unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let (addr, dir) = (words[3].to_string(), words[5].to_string());
    let started = Instant::now();
    let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let killer = kill_every.map(|every| {
        let (tag, running) = (tag.clone(), running.clone());
        std::thread::spawn(move || {
            let mut killed = Vec::new();
            let mut next = Instant::now() + Duration::from_secs(3);
            while running.load(std::sync::atomic::Ordering::SeqCst) && killed.len() < MAX_KILLS {
                if Instant::now() < next {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                let node = KILL_ORDER[killed.len() % KILL_ORDER.len()];
                if let Some(pid) = pid_of(&tag, node) {
                    // SAFETY: SIGKILL to a process this test started (through the launcher).
                    unsafe {
                        libc::kill(pid as i32, libc::SIGKILL);
                    }
                    eprintln!("soak round {round}: killed {node} (pid {pid})");
                    killed.push(node.to_string());
                }
                next = Instant::now() + every;
            }
            killed
        })
    });

    let outcomes: Vec<Outcome> = rt.block_on(async {
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
        let handles: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (url, sem) = (url.clone(), sem.clone());
                tokio::spawn(async move {
                    let _permit = sem.acquire().await.unwrap();
                    one(url, i).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(
                tokio::time::timeout(Duration::from_secs(240), h)
                    .await
                    .expect("the soak is bounded")
                    .unwrap(),
            );
        }
        out
    });
    running.store(false, std::sync::atomic::Ordering::SeqCst);
    let killed: Vec<String> = killer.map(|k| k.join().unwrap()).unwrap_or_default();
    if kill_every.is_some() {
        assert!(!killed.is_empty(), "round {round}: no instance was killed");
    }
    let (mut ok, mut failed, mut rejected, mut aborted) = (0, 0, 0, 0);
    for o in &outcomes {
        match o {
            Outcome::Ok(i, ids) => {
                assert_eq!(ids, &reference[i % PROMPTS], "round {round} request {i}");
                ok += 1;
            }
            Outcome::Failed(status, msg) => {
                assert!(
                    [200, 400, 500, 502, 503, 504].contains(status) && msg.contains("message"),
                    "round {round}: unclear failure {status}: {msg}"
                );
                failed += 1;
            }
            Outcome::Rejected => rejected += 1,
            Outcome::Aborted => aborted += 1,
        }
    }
    eprintln!(
        "soak round {round} ({mode}): {ok} ok, {failed} failed with a clear error, {rejected} rejected, {aborted} aborted, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        ok >= REQUESTS / 3,
        "round {round}: too few successes ({ok})"
    );
    assert_eq!(rejected + failed + ok + aborted, REQUESTS);

    // Everything settles: pools full, nothing in flight, no actor failed, one restart each.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = cluster_json(&addr, &dir);
        let settled = v["instances"].as_array().unwrap().iter().all(|m| {
            let s = &m["snapshot"];
            s["kv_blocks_free"] == s["kv_blocks_total"]
                && s["waiting"] == 0
                && s["running"] == 0
                && s["transfers_in_flight"] == 0
                && s["actors"]["children"]
                    .as_array()
                    .is_some_and(|c| c.iter().all(|a| a["state"] != "starting"))
        });
        if settled {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "round {round}: never settled: {v}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let instances = v["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 3, "{v}");
    for m in instances {
        let snap = &m["snapshot"];
        let children = snap["actors"]["children"].as_array().unwrap();
        let kinds: Vec<&str> = children
            .iter()
            .map(|c| c["kind"].as_str().unwrap())
            .collect();
        for kind in [
            "Scheduler",
            "TpWorker",
            "Aggregator",
            "KvSender",
            "KvReceiver",
            "HttpFrontend",
        ] {
            assert!(kinds.contains(&kind), "round {round}: {kind} missing: {m}");
        }
        for c in children {
            assert_eq!(c["state"], "running", "round {round}: {c}");
        }
        let victim = children.iter().find(|c| c["kind"] == target).unwrap();
        let expected = u64::from(used_by.contains(&m["role"].as_str().unwrap()));
        if killed.iter().any(|k| m["node"] == k.as_str()) {
            // A restarted process injects its one panic again only if the load reached it.
            assert!(
                victim["restarts"].as_u64().unwrap() <= expected,
                "round {round}: {m}"
            );
        } else {
            assert_eq!(
                victim["restarts"], expected,
                "round {round}: the injected {target} panic shows as {expected} restart(s): {m}"
            );
        }
        let depth: u64 = children
            .iter()
            .map(|c| c["mailbox_depth"].as_u64().unwrap())
            .sum();
        assert_eq!(
            depth, 0,
            "round {round}: a settled instance has empty mailboxes: {m}"
        );
    }

    // SIGTERM: nothing left behind.
    drop(launcher);
    assert_none_left(&tag);
}

#[test]
fn soak_1p2d_under_injected_faults_three_rounds() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let reference = rt.block_on(reference());
    for (r, mode) in [(1, "push"), (2, "pull"), (3, "push")] {
        round(&rt, r, mode, &reference, None);
    }
}

/// The round of processes coming and going: the same load and faults, and a whole instance
/// process SIGKILLed (and restarted by the launcher) each minute of the run — and once 3 s
/// in, so every run has one — at most three times. The proxy migrates the broken streams and
/// retries the broken prefills; the same invariants hold at the end.
#[test]
fn soak_1p2d_with_an_instance_process_killed_each_minute() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let reference = rt.block_on(reference());
    round(&rt, 4, "push", &reference, Some(Duration::from_secs(60)));
}
