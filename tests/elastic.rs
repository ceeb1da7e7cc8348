//! Processes coming and going under load, against `pdserve launch` clusters (1P2D, the
//! synthetic model): a decode instance SIGKILLed under 16 greedy streams and 4 non-streamed
//! requests (every one completes with the text of an uninterrupted run: request migration); a
//! decode instance drained under load (no request fails, the pools end full), a third decode
//! instance scaled in while the cluster serves (it receives traffic), one joining by hand
//! (`serve --join`), and the prefill instance SIGKILLed and restarted under load (no request
//! fails, no block stays stranded).

mod common;

use common::{assert_none_left, inspect, sigterm_and_wait, tagged_processes};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A launched cluster: the launcher (SIGTERMed when dropped), its proxy URL, the proxy's
/// control address and the credentials directory.
struct Cluster {
    launcher: Child,
    url: String,
    control: String,
    dir: String,
    tag: String,
}

impl Cluster {
    fn launch(tag_name: &str, model: &str, extra: &[&str]) -> Self {
        let tag = format!("{tag_name}={}", std::process::id());
        let (key, value) = tag.split_once('=').unwrap();
        let mut launcher = Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args([
                "launch",
                "--model",
                model,
                "--decode",
                "2",
                "--port",
                "0",
                "--threads",
                "1",
            ])
            .args(extra)
            .env(key, value)
            .env("PDSERVE_LOGGING__FILTER", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
        let url = lines.next().expect("launcher printed nothing").unwrap();
        let line = lines.next().expect("no inspect line").unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let (control, dir) = (words[3].to_string(), words[5].to_string());
        Self {
            launcher,
            url,
            control,
            dir,
            tag,
        }
    }

    /// `pdserve inspect --json` of the cluster.
    fn inspect(&self) -> Value {
        let (ok, out, err) = inspect(&[&self.control, "--credentials-dir", &self.dir, "--json"]);
        assert!(ok, "inspect failed: {err}");
        serde_json::from_str(&out).unwrap()
    }

    /// Waits (bounded) until `pred` holds for the cluster's inspect snapshot.
    fn wait_for(&self, what: &str, secs: u64, mut pred: impl FnMut(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.inspect();
            if pred(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {secs} s: {v:#}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The pid of the child serving instance `name`.
    fn pid_of(&self, name: &str) -> u32 {
        let needle = format!("--name\0{name}\0");
        tagged_processes(&self.tag)
            .into_iter()
            .find(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
            })
            .unwrap_or_else(|| panic!("no process serves {name}"))
    }

    fn metric(&self, name: &str) -> f64 {
        let text = http_get(&format!("{}/metrics", self.url));
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.launcher.try_wait().ok().flatten().is_none() {
            let status = sigterm_and_wait(&mut self.launcher);
            if !std::thread::panicking() {
                assert!(status.success(), "{status}");
                assert_none_left(&self.tag);
            }
        }
    }
}

/// A blocking GET of a figures page (`/metrics`).
fn http_get(url: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = pdserve_actors::http::http_client().build().unwrap();
        client.get(url).send().await.unwrap().text().await.unwrap()
    })
}

/// Every instance's pool is full and no hand-off is in flight.
fn pools_full(v: &Value) -> bool {
    v["instances"].as_array().unwrap().iter().all(|m| {
        let s = &m["snapshot"];
        m["routable"] == false
            || (s["kv_blocks_free"] == s["kv_blocks_total"]
                && s["transfers_in_flight"] == 0
                && s["running"] == 0
                && s["waiting"] == 0)
    })
}

fn routable(v: &Value, node: &str) -> bool {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["node"] == node && m["routable"] == true)
}

/// The outcome of one streamed request: its text, or why it failed.
async fn stream(
    url: &str,
    body: &Value,
    started: Option<Arc<AtomicUsize>>,
) -> Result<String, String> {
    let mut r = post_completion(url, body).await?;
    if r.status() != 200 {
        return Err(format!(
            "{}: {}",
            r.status(),
            r.text().await.unwrap_or_default()
        ));
    }
    let mut raw = String::new();
    let mut counted = false;
    while let Some(chunk) = r.chunk().await.map_err(|e| e.to_string())? {
        raw.push_str(&String::from_utf8_lossy(&chunk));
        if !counted && raw.contains("\"text\"") {
            counted = true;
            if let Some(s) = &started {
                s.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let mut text = String::new();
    let mut done = false;
    // SSE comments (`:` lines: keep-alives sent after 15 s without an event, which a slow
    // debug build can reach while the byte-level tokenizer holds back partial characters)
    // carry nothing.
    for event in raw
        .split("\n\n")
        .filter(|e| !e.trim().is_empty() && !e.trim_start().starts_with(':'))
    {
        let data = event
            .trim()
            .strip_prefix("data: ")
            .ok_or(format!("not data: {event}"))?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {v}"));
        }
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    if !done {
        return Err(format!("no [DONE]: {raw}"));
    }
    Ok(text)
}

/// `POST {url}/v1/completions` with `body`.
async fn post_completion(url: &str, body: &Value) -> Result<reqwest::Response, String> {
    pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())
}

/// The text of one non-streamed completion, or why it failed.
async fn complete_text(url: &str, body: &Value) -> Result<String, String> {
    let r = post_completion(url, body).await?;
    let status = r.status();
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{status}: {v}"));
    }
    Ok(v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

/// A greedy streamed completion (greedy output is the same wherever it is computed; seeded
/// continuation is checked on one instance, `actors/tests/instance.rs`).
fn body(i: usize, max_tokens: usize) -> Value {
    json!({"prompt": format!("request {i}: tell a long story"), "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true, "stream": true})
}

#[test]
fn streams_of_a_killed_decode_instance_migrate_and_match_an_uninterrupted_run() {
    const STREAMS: usize = 16;
    const WHOLE: usize = 4;
    // Long enough that every stream still runs when its decode instance dies (a deeper synthetic model
    // than `tiny`, near its context).
    const TOKENS: usize = 900;
    let cluster = Cluster::launch("PDSERVE_TEST_ELASTIC_KILL", "synthetic:tiny,layers=8", &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = cluster.url.clone();
    // The uninterrupted run, one stream at a time.
    let reference: Vec<String> = rt.block_on(async {
        let mut out = Vec::new();
        for i in 0..STREAMS {
            out.push(
                stream(&url, &body(i, TOKENS), None)
                    .await
                    .expect("reference run"),
            );
        }
        out
    });
    let migrations_before = cluster.metric("pdserve_migrations_total");
    // The same streams at once; a decode instance serving them is killed once every stream
    // has produced text.
    let started = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (url, started) = (url.clone(), started.clone());
            rt.spawn(async move { stream(&url, &body(i, TOKENS), Some(started)).await })
        })
        .collect();
    // Non-streamed requests beside them: one that breaks is re-issued whole.
    let whole: Vec<_> = (0..WHOLE)
        .map(|i| {
            let url = url.clone();
            let mut b = body(i, TOKENS);
            b["stream"] = json!(false);
            rt.spawn(async move { complete_text(&url, &b).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.load(Ordering::SeqCst) < STREAMS {
        assert!(Instant::now() < deadline, "the streams did not all start");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The decode instance running the most of them dies (the proxy may have put all of
    // them on either one: it routes a burst on loads up to one heartbeat old).
    let decode_running = |v: &Value| {
        v["instances"].as_array().unwrap().iter().any(|m| {
            m["node"].as_str().is_some_and(|n| n.starts_with("decode-"))
                && m["snapshot"]["running"].as_u64() > Some(0)
        })
    };
    let snap = cluster.wait_for("streams running on a decode instance", 10, decode_running);
    let (victim_name, running) = snap["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["node"].as_str().is_some_and(|n| n.starts_with("decode-")))
        .map(|m| {
            let n = m["node"].as_str().unwrap().to_string();
            (n, m["snapshot"]["running"].as_u64().unwrap_or(0))
        })
        .max_by_key(|(_, running)| *running)
        .expect("two decode instances");
    assert!(running > 0, "no stream runs on a decode instance: {snap:#}");
    eprintln!("killing {victim_name}, running {running} stream(s)");
    let victim = cluster.pid_of(&victim_name);
    // SAFETY: SIGKILL to a process this test started (through the launcher).
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let killed_at = Instant::now();
    let results: Vec<_> = handles
        .into_iter()
        .map(|h| rt.block_on(h).unwrap())
        .collect();
    eprintln!(
        "streams ended {:.1} s after the kill",
        killed_at.elapsed().as_secs_f64()
    );
    for (i, r) in results.iter().enumerate() {
        let text = r
            .as_ref()
            .unwrap_or_else(|e| panic!("stream {i} failed: {e}"));
        assert_eq!(
            text, &reference[i],
            "stream {i} differs from the uninterrupted run"
        );
    }
    for (i, h) in whole.into_iter().enumerate() {
        let text = rt
            .block_on(h)
            .unwrap()
            .unwrap_or_else(|e| panic!("non-streamed request {i} failed: {e}"));
        assert_eq!(
            text, reference[i],
            "non-streamed request {i} differs from the uninterrupted run"
        );
    }
    let migrated = cluster.metric("pdserve_migrations_total") - migrations_before;
    eprintln!("{migrated} request(s) migrated");
    assert!(migrated >= 1.0, "no migration counted ({migrated})");
    assert!(migrated <= (STREAMS + WHOLE) as f64, "{migrated}");
}

#[test]
fn drain_scale_up_and_a_prefill_restart_under_load_fail_nothing_and_strand_no_block() {
    const CONCURRENCY: usize = 8;
    const ROUNDS: usize = 3;
    let cluster = Cluster::launch(
        "PDSERVE_TEST_ELASTIC_DRAIN",
        "synthetic:tiny",
        &["--drain-timeout", "20"],
    );
    let v = cluster.wait_for("both decode instances routable", 30, |v| {
        routable(v, "decode-0") && routable(v, "decode-1")
    });
    let decode1 = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node"] == "decode-1")
        .unwrap()["url"]
        .as_str()
        .unwrap()
        .to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = cluster.url.clone();
    // Concurrency 8, a few rounds each; decode-1 is drained once the first round runs.
    let started = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..CONCURRENCY)
        .map(|c| {
            let (url, started) = (url.clone(), started.clone());
            rt.spawn(async move {
                let mut failures = Vec::new();
                for round in 0..ROUNDS {
                    let b = body(c * ROUNDS + round, 120);
                    if let Err(e) = stream(&url, &b, Some(started.clone())).await {
                        failures.push(e);
                    }
                }
                failures
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.load(Ordering::SeqCst) < CONCURRENCY {
        assert!(Instant::now() < deadline, "the load did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["drain", &decode1, "--wait", "60"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pdserve drain: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let failures: Vec<String> = handles
        .into_iter()
        .flat_map(|h| rt.block_on(h).unwrap())
        .collect();
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    // decode-1 is gone for good (the launcher does not restart a drained instance); the
    // others end with full pools.
    let v = cluster.wait_for("pools full after the drain", 30, pools_full);
    assert!(!routable(&v, "decode-1"), "{v:#}");
    assert!(
        routable(&v, "decode-0") && routable(&v, "prefill-0"),
        "{v:#}"
    );

    // Scale up: a new decode instance joins and gets requests.
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(["scale", "decode", "2", "--credentials-dir", &cluster.dir])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pdserve scale: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started_text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(started_text.contains("started decode-2"), "{started_text}");
    cluster.wait_for("decode-2 routable", 60, |v| routable(v, "decode-2"));
    rt.block_on(async {
        let all: Vec<_> = (0..CONCURRENCY)
            .map(|i| {
                let url = url.clone();
                tokio::spawn(async move { stream(&url, &body(100 + i, 40), None).await })
            })
            .collect();
        for h in all {
            h.await.unwrap().expect("request after the scale-up");
        }
    });
    let v = cluster.inspect();
    let served = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node"] == "decode-2")
        .map(|m| m["snapshot"]["kv_blocks_total"].clone());
    assert!(served.is_some(), "{v:#}");
    let decode2_url = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node"] == "decode-2")
        .unwrap()["url"]
        .as_str()
        .unwrap()
        .to_string();
    let metrics = http_get(&format!("{decode2_url}/metrics"));
    let generated: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("pdserve_generated_tokens_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(generated > 0.0, "decode-2 served nothing:\n{metrics}");

    // An instance started by hand joins the running cluster (`serve --join`, its member
    // credentials issued from the launch directory's CA), is routed to, and leaves on SIGTERM.
    // Its stdout and stderr go to a log printed if the test fails.
    let mut joined = common::Procs::new();
    joined.spawn(
        "decode-9",
        Command::new(env!("CARGO_BIN_EXE_pdserve"))
            .args(["serve", "--role", "decode", "--name", "decode-9"])
            .args(["--model", "synthetic:tiny", "--port", "0", "--threads", "1"])
            .args(["--transfer", "shm", "--credentials-dir", &cluster.dir])
            .args(["--join", &cluster.control])
            .env("PDSERVE_LOGGING__FILTER", "warn"),
    );
    cluster.wait_for("decode-9 routable", 60, |v| {
        joined.assert_running();
        routable(v, "decode-9")
    });
    let decode9_url = cluster.inspect()["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node"] == "decode-9")
        .unwrap()["url"]
        .as_str()
        .unwrap()
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    loop {
        // Bursts of concurrent requests until one lands on decode-9 (bounded).
        rt.block_on(async {
            let all: Vec<_> = (0..4)
                .map(|k| {
                    let url = url.clone();
                    tokio::spawn(
                        async move { stream(&url, &body(300 + i * 4 + k, 20), None).await },
                    )
                })
                .collect();
            for h in all {
                h.await.unwrap().expect("request while decode-9 serves");
            }
        });
        i += 1;
        let served: f64 = http_get(&format!("{decode9_url}/metrics"))
            .lines()
            .filter(|l| l.starts_with("pdserve_generated_tokens_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if served > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "decode-9 joined but was never routed to"
        );
    }
    let status = sigterm_and_wait(joined.stopping("decode-9"));
    assert!(status.success(), "decode-9 after SIGTERM: {status}");
    cluster.wait_for("decode-9 gone", 30, |v| !routable(v, "decode-9"));

    // The prefill instance dies mid-run and is restarted by the launcher: requests whose
    // hand-off it broke are prefilled elsewhere (the proxy's prefill retry: with no other
    // prefill instance, on the decode instance), none fails, and no block stays stranded.
    let started = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..CONCURRENCY)
        .map(|i| {
            let (url, started) = (url.clone(), started.clone());
            rt.spawn(async move {
                let mut failures = Vec::new();
                for round in 0..ROUNDS {
                    if let Err(e) = stream(
                        &url,
                        &body(200 + i * ROUNDS + round, 60),
                        Some(started.clone()),
                    )
                    .await
                    {
                        failures.push(e);
                    }
                }
                failures
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.load(Ordering::SeqCst) < CONCURRENCY / 2 {
        assert!(Instant::now() < deadline, "the load did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    let prefill = cluster.pid_of("prefill-0");
    // SAFETY: SIGKILL to a process this test started (through the launcher).
    unsafe {
        libc::kill(prefill as i32, libc::SIGKILL);
    }
    let failures: Vec<String> = handles
        .into_iter()
        .flat_map(|h| rt.block_on(h).unwrap())
        .collect();
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    eprintln!(
        "prefill retries after the kill: {}",
        cluster.metric("pdserve_prefill_retries_total")
    );
    cluster.wait_for("prefill-0 back and every pool full", 90, |v| {
        routable(v, "prefill-0") && pools_full(v)
    });
}
