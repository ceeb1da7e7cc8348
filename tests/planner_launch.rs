//! `pdserve launch --planner throughput` on the synthetic model: a load step makes the planner
//! add a prefill instance; when the load falls back it drains that instance again, while
//! requests keep coming, and no request fails across either change.
//!
//! The engine curves are the test's own (a prefill instance that computes 200 prompt tokens/s),
//! so that a load this machine can generate needs two prefill instances whatever its speed:
//! the test checks the driver and the scale path, not the curves.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const CURVES: &str = r#"
[engine]
model = "planner test: a slow prefill engine"
max_batch = 64
kv_capacity_tokens = 65536
kv_bytes_per_token = 1024
startup_s = 1.0

[[prefill]]
tokens = 16
tokens_per_s = 200.0

[[prefill]]
tokens = 512
tokens_per_s = 200.0

[[decode]]
batch = 1
context = 32.0
step_ms = 2.0

[[decode]]
batch = 8
context = 32.0
step_ms = 4.0

[[decode]]
batch = 1
context = 2048.0
step_ms = 3.0

[[handoff]]
bytes = 1000000
ms = 1.0

[[handoff]]
bytes = 2000000
ms = 2.0
"#;

/// Waits (bounded by `within`) for a launcher line containing every one of `words`; every
/// line read is kept in `seen`.
fn wait_line(
    lines: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
    words: &[&str],
    within: Duration,
) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Some(l) = seen.iter().find(|l| words.iter().all(|w| l.contains(w))) {
            return l.clone();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no launcher line with {words:?} within {within:?}; lines so far:\n{}",
            seen.join("\n")
        );
        if let Ok(l) = lines.recv_timeout(left.min(Duration::from_millis(200))) {
            seen.push(l);
        }
    }
}

#[test]
fn the_planner_adds_a_prefill_instance_under_a_load_step_and_drains_it_after_without_failures() {
    let dir = tempfile::tempdir().unwrap();
    let curves = dir.path().join("curves.toml");
    std::fs::write(&curves, CURVES).unwrap();
    let tag = format!("planner_launch={}", std::process::id());
    let (key, value) = tag.split_once('=').unwrap();
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args([
            "launch",
            "--model",
            "synthetic:tiny",
            "--prefill",
            "1",
            "--decode",
            "1",
        ])
        .args(["--port", "0", "--threads", "1", "--drain-timeout", "30"])
        .args(["--planner", "throughput", "--planner-window-s", "1"])
        .args(["--planner-max-prefill", "2", "--planner-max-decode", "1"])
        .arg("--planner-curves")
        .arg(&curves)
        .env(key, value)
        .env("PDSERVE_LOGGING__FILTER", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its stdout (the URL, then the inspect line) stays open until the end.
    let mut stdout = BufReader::new(launcher.stdout.take().unwrap()).lines();
    let url = stdout
        .next()
        .expect("the launcher printed nothing")
        .unwrap();
    let (tx, lines) = mpsc::channel();
    let stderr = launcher.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = pdserve_actors::http::http_client().build().unwrap();
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let sent = Arc::new(AtomicUsize::new(0));
    // One request: a completion of 8 tokens; any answer but 200 is a failure.
    let request = {
        let (client, url, failures, sent) =
            (client.clone(), url.clone(), failures.clone(), sent.clone());
        move |i: usize| {
            let (client, url, failures, sent) =
                (client.clone(), url.clone(), failures.clone(), sent.clone());
            async move {
                let body = serde_json::json!({"prompt": format!("planner load {i}: a few words of prompt"),
                                              "max_tokens": 8, "temperature": 0, "ignore_eos": true});
                sent.fetch_add(1, Ordering::SeqCst);
                match client
                    .post(format!("{url}/v1/completions"))
                    .timeout(Duration::from_secs(60))
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 200 => {}
                    Ok(r) => {
                        let what = format!("{} {}", r.status(), r.text().await.unwrap_or_default());
                        failures.lock().unwrap().push(what);
                    }
                    Err(e) => failures.lock().unwrap().push(e.to_string()),
                }
            }
        }
    };

    // The step: 4 clients back to back (bounded: 400 requests each at most) until the planner
    // has started a second prefill instance.
    let stop_step = Arc::new(AtomicBool::new(false));
    let step: Vec<_> = (0..4)
        .map(|w| {
            let (request, stop) = (request.clone(), stop_step.clone());
            rt.spawn(async move {
                for i in 0..400 {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    request(w * 1000 + i).await;
                }
            })
        })
        .collect();
    let up = wait_line(
        &lines,
        &mut seen,
        &["planner", "started prefill-1"],
        Duration::from_secs(90),
    );
    eprintln!("scale-up: {up}");
    stop_step.store(true, Ordering::SeqCst);
    for h in step {
        rt.block_on(h).unwrap();
    }

    // Then a trickle (one request a second, 200 at most) across the scale-down: the
    // planner drains prefill-1 while requests keep arriving.
    let stop_trickle = Arc::new(AtomicBool::new(false));
    let trickle = {
        let (request, stop) = (request.clone(), stop_trickle.clone());
        rt.spawn(async move {
            for i in 0..200 {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                request(100_000 + i).await;
                tokio::time::sleep(Duration::from_millis(1000)).await;
            }
        })
    };
    let down = wait_line(
        &lines,
        &mut seen,
        &["planner", "draining prefill-1"],
        Duration::from_secs(90),
    );
    eprintln!("scale-down: {down}");
    wait_line(
        &lines,
        &mut seen,
        &["prefill-1 drained and stopped"],
        Duration::from_secs(60),
    );
    // A few more requests after the drained instance has gone.
    std::thread::sleep(Duration::from_secs(2));
    stop_trickle.store(true, Ordering::SeqCst);
    rt.block_on(trickle).unwrap();

    let failures = failures.lock().unwrap().clone();
    let total = sent.load(Ordering::SeqCst);
    assert!(total > 0);
    assert!(
        failures.is_empty(),
        "{} of {total} requests failed: {failures:?}",
        failures.len()
    );
    eprintln!("{total} requests across the scale-up and the scale-down, none failed");
    assert!(
        matches!(launcher.try_wait(), Ok(None)),
        "the launcher exited"
    );
    common::sigterm_and_wait(&mut launcher);
    drop(stdout);
    common::assert_none_left(&tag);
}
