//! End-to-end tests of `pdserve bench serve` against a mock OpenAI-compatible SSE server (axum on
//! 127.0.0.1, port chosen at run time).
//!
//! The module is included by path, so these tests drive its library entry point
//! ([`bench_serve::run_bench`]) directly, and its unit tests run here too. The last test drives the
//! real binary.
//!
//! No test sizes work against the wall clock: where a request must still be running when the
//! duration or a timeout ends, the mock holds it until the test releases it (or forever), and
//! the only time bounds left are generous liveness bounds that say what they protect.

#[allow(dead_code)]
#[path = "../bin/bench_serve.rs"]
mod bench_serve;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bench_serve::{run_bench, BenchConfig, Endpoint, LenSpec, PromptSource, Slo};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MOCK_MODEL: &str = "mock-model";

/// How the mock answers.
#[derive(Clone, Copy, Debug)]
struct MockOptions {
    /// Delay before the first content chunk.
    first_delay: Duration,
    /// Delay before every later content chunk.
    chunk_delay: Duration,
    /// Every k-th request (1-based) gets a 400 with a JSON error; 0 = never.
    fail_every: usize,
    /// Every k-th request gets an error object in its stream after the first token; 0 = never.
    stream_error_every: usize,
    /// Hold every answer (after its headers) until [`Mock::release`]: a server as slow as the
    /// test needs, whatever the machine.
    hold: bool,
}

impl Default for MockOptions {
    fn default() -> Self {
        MockOptions {
            first_delay: Duration::from_millis(50),
            chunk_delay: Duration::from_millis(10),
            fail_every: 0,
            stream_error_every: 0,
            hold: false,
        }
    }
}

#[derive(Debug, Default)]
struct Mock {
    opts: Option<MockOptions>,
    requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    bodies: Mutex<Vec<Value>>,
    auth: Mutex<Vec<Option<String>>>,
    /// When the first completion request arrived.
    first_seen: Mutex<Option<Instant>>,
    /// Held answers go on once this is set ([`Mock::release`]).
    released: std::sync::atomic::AtomicBool,
    release: tokio::sync::Notify,
}

impl Mock {
    /// Lets every held answer (and every later one) go on.
    fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.release.notify_waiters();
    }

    /// Waits until [`Mock::release`] (at once when not holding).
    async fn held(&self) {
        loop {
            let released = self.release.notified();
            if !self.opts.unwrap().hold || self.released.load(Ordering::SeqCst) {
                return;
            }
            released.await;
        }
    }

    /// Waits (bounded) until the mock has seen `n` completion requests.
    async fn wait_requests(&self, n: usize) {
        // Liveness bound: the requests are sent at once; 60 s only catches a client that
        // never sends them.
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.requests.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "the mock saw {} of {n} requests",
                self.requests.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Counts a request in flight until its answer (or its stream) is dropped.
struct InFlight(Arc<Mock>);

impl InFlight {
    fn new(mock: &Arc<Mock>) -> Self {
        let now = mock.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        mock.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(mock.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn start_mock(opts: MockOptions) -> (String, Arc<Mock>) {
    let mock = Arc::new(Mock {
        opts: Some(opts),
        ..Default::default()
    });
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": MOCK_MODEL}]})) }),
        )
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), mock)
}

async fn completions(
    State(m): State<Arc<Mock>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    answer(m, &headers, body, false)
}

async fn chat(State(m): State<Arc<Mock>>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    answer(m, &headers, body, true)
}

fn answer(mock: Arc<Mock>, headers: &HeaderMap, body: Value, chat: bool) -> Response {
    let guard = InFlight::new(&mock);
    let opts = mock.opts.unwrap();
    mock.first_seen
        .lock()
        .unwrap()
        .get_or_insert_with(Instant::now);
    let n = mock.requests.fetch_add(1, Ordering::SeqCst) + 1;
    mock.bodies.lock().unwrap().push(body.clone());
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    mock.auth.lock().unwrap().push(auth);
    if opts.fail_every > 0 && n.is_multiple_of(opts.fail_every) {
        let err = json!({"error": {"message": format!("mock failure {n}"), "type": "BadRequestError", "code": 400}});
        return (StatusCode::BAD_REQUEST, Json(err)).into_response();
    }
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let prompt = if chat {
        &body["messages"][0]["content"]
    } else {
        &body["prompt"]
    };
    let prompt_tokens = prompt.as_str().map_or(0, |p| p.split_whitespace().count());
    let stream_error = opts.stream_error_every > 0 && n.is_multiple_of(opts.stream_error_every);

    let zero = Duration::ZERO;
    let mut script: Vec<(Duration, String)> = vec![(zero, ": keep-alive\n\n".into())];
    if chat {
        let role = json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
        script.push((zero, format!("data: {role}\n\n")));
    }
    for i in 0..max_tokens {
        let chunk = if chat {
            json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": format!(" tok{i}")}}], "usage": null})
        } else {
            json!({"object": "text_completion", "choices": [{"index": 0, "text": format!(" tok{i}")}], "usage": null})
        };
        let event = format!("data: {chunk}\r\n\r\n");
        // Two writes per event, so the client reads a line cut in the middle.
        let (a, b) = event.split_at(event.len() / 2);
        let delay = if i == 0 {
            opts.first_delay
        } else {
            opts.chunk_delay
        };
        script.push((delay, a.to_string()));
        script.push((Duration::from_millis(1), b.to_string()));
        if stream_error {
            script.push((
                zero,
                "data: {\"error\": {\"message\": \"mock stream error\", \"code\": 500}}\n\n".into(),
            ));
            break;
        }
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}});
    script.push((zero, format!("data: {usage}\n\n")));
    script.push((zero, "data: [DONE]\n\n".into()));
    let last = script.len() - 1;
    // The request stops counting as in flight just before [DONE] goes out (or when the client
    // drops the stream early), so the client's next request never overlaps it.
    let mut guard = Some(guard);
    let stream = futures_util::stream::iter(script.into_iter().enumerate())
        .then(move |(i, (delay, text))| {
            let mock = mock.clone();
            async move {
                if i == 0 {
                    mock.held().await;
                }
                tokio::time::sleep(delay).await;
                (i, text)
            }
        })
        .map(move |(i, text)| {
            if i == last {
                guard.take();
            }
            Ok::<_, std::io::Error>(Bytes::from(text))
        });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn config(url: &str) -> BenchConfig {
    BenchConfig {
        url: url.to_string(),
        endpoint: Endpoint::Completions,
        model: None,
        api_key: None,
        concurrency: Some(3),
        request_rate: None,
        seed: 0,
        num_requests: 12,
        first_request: 0,
        duration: Duration::from_secs(30),
        request_timeout: Duration::from_secs(10),
        prompts: PromptSource::Synthetic(LenSpec::Fixed(8)),
        output_len: LenSpec::Fixed(5),
        slo: Slo::default(),
    }
}

const STATS_KEYS: [&str; 4] = ["mean", "p50", "p90", "p99"];

/// Every key the `--json` output documents.
fn assert_documented_keys(v: &Value) {
    for key in [
        "url",
        "endpoint",
        "model",
        "concurrency",
        "request_rate",
        "issued",
        "completed",
        "failed",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "usage_missing",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "goodput",
        "slo",
        "errors",
    ] {
        assert!(v.get(key).is_some(), "missing key {key} in {v}");
    }
    for key in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
        for stat in STATS_KEYS {
            assert!(v[key].get(stat).is_some(), "missing {key}.{stat} in {v}");
        }
    }
    for key in ["ttft_ms", "tpot_ms", "e2e_ms"] {
        assert!(v["slo"].get(key).is_some(), "missing slo.{key}");
    }
    assert!(v["errors"].is_array());
}

fn stat(v: &Value, key: &str, s: &str) -> f64 {
    v[key][s]
        .as_f64()
        .unwrap_or_else(|| panic!("{key}.{s} is not a number in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_counts_tokens_latencies_and_failures() {
    let opts = MockOptions {
        fail_every: 4,
        chunk_delay: Duration::from_millis(50),
        ..Default::default()
    };
    let (url, mock) = start_mock(opts).await;
    let cfg = BenchConfig {
        api_key: Some("secret".into()),
        slo: Slo {
            e2e_ms: Some(60_000.0),
            ..Default::default()
        },
        ..config(&url)
    };
    let report = run_bench(&cfg).await.unwrap();

    assert_eq!((report.issued, report.completed, report.failed), (12, 9, 3));
    assert_eq!(report.model, MOCK_MODEL);
    assert_eq!(
        report.total_output_tokens,
        9 * 5,
        "output tokens are the mock's usage"
    );
    assert_eq!(
        report.total_input_tokens,
        9 * 8,
        "prompt tokens are the mock's usage"
    );
    assert_eq!(report.usage_missing, 0);
    assert_eq!(report.errors.len(), 3);
    for e in &report.errors {
        assert!(e.contains("HTTP 400") && e.contains("mock failure"), "{e}");
    }
    let v = serde_json::to_value(&report).unwrap();
    assert_documented_keys(&v);
    let first_ms = opts.first_delay.as_secs_f64() * 1000.0;
    for s in STATS_KEYS {
        assert!(
            stat(&v, "ttft_ms", s) >= first_ms,
            "ttft {s} below the mock's first delay: {v}"
        );
        assert!(
            stat(&v, "e2e_ms", s) >= first_ms + 4.0 * 50.0,
            "e2e {s}: {v}"
        );
    }
    // Later chunks leave the mock every >= 51 ms (50 ms + 1 ms for the split write); only
    // counting role/keep-alive chunks or timing whole bodies would put these gaps near 0. The
    // 10x margin absorbs a first chunk read late on a loaded machine (up to ~160 ms late for
    // the mean).
    assert!(stat(&v, "tpot_ms", "mean") >= 5.0, "{v}");
    assert!(stat(&v, "itl_ms", "p50") >= 5.0, "{v}");
    assert!(report.duration_s > 0.0);
    assert!((report.request_throughput - 9.0 / report.duration_s).abs() < 1e-9);
    assert!((report.output_throughput - 45.0 / report.duration_s).abs() < 1e-9);
    assert!((report.total_token_throughput - 117.0 / report.duration_s).abs() < 1e-9);
    assert_eq!(
        report.goodput, report.request_throughput,
        "every success meets a 60 s E2E SLO"
    );

    // Closed loop: exactly the configured number in flight at most.
    assert_eq!(mock.max_in_flight.load(Ordering::SeqCst), 3);
    let bodies = mock.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 12);
    for b in bodies.iter() {
        assert_eq!(b["model"], MOCK_MODEL);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(
            (b["max_tokens"].as_u64(), b["min_tokens"].as_u64()),
            (Some(5), Some(5))
        );
        assert_eq!(b["temperature"].as_f64(), Some(0.0));
        assert_eq!(b["prompt"].as_str().unwrap().split_whitespace().count(), 8);
    }
    assert!(mock
        .auth
        .lock()
        .unwrap()
        .iter()
        .all(|a| a.as_deref() == Some("Bearer secret")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_skips_role_chunks_and_reports_stream_errors() {
    let opts = MockOptions {
        stream_error_every: 3,
        ..Default::default()
    };
    let (url, mock) = start_mock(opts).await;
    let cfg = BenchConfig {
        endpoint: Endpoint::Chat,
        model: Some("given-model".into()),
        concurrency: Some(2),
        num_requests: 6,
        ..config(&url)
    };
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!((report.completed, report.failed), (4, 2));
    assert_eq!(report.model, "given-model");
    assert_eq!(report.total_output_tokens, 4 * 5);
    assert!(
        report
            .errors
            .iter()
            .all(|e| e.contains("mock stream error")),
        "{:?}",
        report.errors
    );
    // The empty role chunk arrives at once; counting it would put TTFT near 0.
    let first_ms = opts.first_delay.as_secs_f64() * 1000.0;
    assert!(report.ttft_ms.p50.unwrap() >= first_ms && report.ttft_ms.mean.unwrap() >= first_ms);
    for b in mock.bodies.lock().unwrap().iter() {
        assert_eq!(b["model"], "given-model");
        assert_eq!(b["messages"][0]["role"], "user");
        assert!(b.get("prompt").is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dataset_prompts_and_output_lengths_are_sent_in_order() {
    let (url, mock) = start_mock(MockOptions {
        first_delay: Duration::from_millis(5),
        ..Default::default()
    })
    .await;
    let path =
        std::env::temp_dir().join(format!("pdserve-bench-serve-{}.jsonl", std::process::id()));
    std::fs::write(
        &path,
        "{\"prompt\": \"one two three\", \"output_len\": 2}\n\n{\"prompt\": \"four\"}\n",
    )
    .unwrap();
    let entries = bench_serve::parse_dataset(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let cfg = BenchConfig {
        prompts: PromptSource::Dataset(entries),
        output_len: LenSpec::Fixed(3),
        concurrency: Some(1),
        num_requests: 3,
        ..config(&url)
    };
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!((report.completed, report.failed), (3, 0));
    assert_eq!(report.total_output_tokens, 2 + 3 + 2);
    assert_eq!(report.total_input_tokens, 3 + 1 + 3);
    let bodies = mock.bodies.lock().unwrap();
    let sent: Vec<(&str, u64)> = bodies
        .iter()
        .map(|b| {
            (
                b["prompt"].as_str().unwrap(),
                b["max_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        sent,
        vec![("one two three", 2), ("four", 3), ("one two three", 2)]
    );
}

/// Liveness bound on a whole benchmark run in these tests: each ends within a few seconds; a
/// run still going after this has ignored its duration or its request timeout.
const RUN_BOUND: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_bounds_a_closed_loop_run() {
    // The mock holds both requests of the closed loop (concurrency 2) until the duration has
    // passed, so no slot frees before it ends: exactly two of the 10 000 are issued.
    let (url, mock) = start_mock(MockOptions {
        hold: true,
        ..Default::default()
    })
    .await;
    let duration = Duration::from_millis(500);
    let cfg = BenchConfig {
        concurrency: Some(2),
        num_requests: 10_000,
        duration,
        ..config(&url)
    };
    let run = tokio::spawn(async move { run_bench(&cfg).await });
    mock.wait_requests(2).await;
    // The run started before the mock saw its first request, so its duration has passed by
    // then + `duration`.
    let first = mock.first_seen.lock().unwrap().unwrap();
    while Instant::now() < first + duration {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    mock.release();
    let report = tokio::time::timeout(RUN_BOUND, run)
        .await
        .expect("the duration did not end a closed-loop run of 10 000 requests")
        .unwrap()
        .unwrap();
    assert_eq!(
        (report.issued, report.completed, report.failed),
        (2, 2, 0),
        "{:?}",
        report.errors
    );
    assert_eq!(mock.requests.load(Ordering::SeqCst), 2);
    assert!(
        report.duration_s >= duration.as_secs_f64(),
        "{}",
        report.duration_s
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_bounds_a_poisson_run() {
    let (url, mock) = start_mock(MockOptions::default()).await;
    let cfg = BenchConfig {
        concurrency: None,
        request_rate: Some(20.0),
        num_requests: 10_000,
        duration: Duration::from_secs(1),
        ..config(&url)
    };
    // The seeded schedule: how many arrivals fall inside the duration.
    let scheduled = bench_serve::PoissonArrivals::new(20.0, cfg.seed)
        .take_while(|&t| t < cfg.duration.as_secs_f64())
        .count();
    assert!(
        (5..100).contains(&scheduled),
        "seed {} schedules {scheduled} arrivals in 1 s at 20/s",
        cfg.seed
    );
    let report = tokio::time::timeout(RUN_BOUND, run_bench(&cfg))
        .await
        .expect("the duration did not end a Poisson run of 10 000 requests")
        .unwrap();
    // No arrival at or after the duration's end is sent; the first ones are (an arrival is
    // only dropped when the run wakes for it after the end, which no machine stalls for).
    assert!(
        (1..=scheduled).contains(&report.issued),
        "issued {} of {scheduled} arrivals scheduled inside the duration",
        report.issued
    );
    assert_eq!(mock.requests.load(Ordering::SeqCst), report.issued);
    assert_eq!(report.failed, 0, "{:?}", report.errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_rate_with_a_concurrency_cap_and_request_count() {
    let (url, mock) = start_mock(MockOptions::default()).await;
    let cfg = BenchConfig {
        concurrency: Some(2),
        request_rate: Some(1000.0),
        num_requests: 8,
        ..config(&url)
    };
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!((report.issued, report.completed), (8, 8));
    assert_eq!(mock.max_in_flight.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_requests_time_out_as_failures() {
    // The mock never answers (it holds every stream and is never released): only the request
    // timeout can end these requests.
    let (url, _mock) = start_mock(MockOptions {
        hold: true,
        ..Default::default()
    })
    .await;
    let cfg = BenchConfig {
        num_requests: 2,
        concurrency: Some(2),
        request_timeout: Duration::from_millis(300),
        ..config(&url)
    };
    let report = tokio::time::timeout(RUN_BOUND, run_bench(&cfg))
        .await
        .expect("the request timeout did not end requests the server never answers")
        .unwrap();
    assert_eq!((report.completed, report.failed), (0, 2));
    assert!(
        report.errors.iter().all(|e| e.contains("timeout")),
        "{:?}",
        report.errors
    );
    assert_eq!(report.ttft_ms.mean, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_an_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = run_bench(&config(&format!("http://127.0.0.1:{port}")))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("unreachable"), "{err:#}");
}

fn pdserve(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(args)
        .env_remove("PDSERVE_LOG")
        .output()
        .expect("running pdserve")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_prints_the_documented_json() {
    let help = tokio::task::spawn_blocking(|| pdserve(&["bench", "serve", "--help"]))
        .await
        .unwrap();
    assert!(
        help.status.success() && String::from_utf8_lossy(&help.stdout).contains("--num-requests"),
        "`pdserve bench serve --help` failed: {}",
        String::from_utf8_lossy(&help.stderr)
    );
    let (url, _mock) = start_mock(MockOptions {
        fail_every: 4,
        ..Default::default()
    })
    .await;
    let out = tokio::task::spawn_blocking(move || {
        pdserve(&[
            "bench",
            "serve",
            "--url",
            &url,
            "--json",
            "--num-requests",
            "12",
            "--concurrency",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--timeout-s",
            "10",
            "--duration-s",
            "30",
            "--slo-ttft-ms",
            "10000",
        ])
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_documented_keys(&v);
    assert_eq!(
        (v["completed"].as_u64(), v["failed"].as_u64()),
        (Some(9), Some(3))
    );
    assert_eq!(v["total_output_tokens"].as_u64(), Some(45));
    assert_eq!(v["slo"]["ttft_ms"].as_f64(), Some(10000.0));

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let down = format!("http://127.0.0.1:{port}");
    let out = tokio::task::spawn_blocking(move || {
        pdserve(&["bench", "serve", "--url", &down, "--num-requests", "1"])
    })
    .await
    .unwrap();
    assert!(
        !out.status.success(),
        "an unreachable server must fail the command"
    );
}
