//! One colocated instance end to end over HTTP: batching equivalence, streaming, bad input,
//! preemption, overload, client disconnects and worker crashes. Every test ends with the
//! block pool full.

mod common;
use common::assert_pool_full;

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_runtime::supervision::RestartPolicy;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn model(spec: &str) -> pdserve_gpu::loader::LoadedModel {
    load_model(&ModelSource::Synthetic(spec.into())).unwrap()
}

async fn start(name: &str, spec: &str, tweak: impl FnOnce(&mut InstanceOptions)) -> Instance {
    let mut opts = InstanceOptions::local(name, model(spec));
    tweak(&mut opts);
    Instance::start(opts).await.unwrap()
}

/// Polls until the pool is full and nothing runs (bounded).
async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let r = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn prompt(i: usize) -> Vec<u32> {
    (0..(5 + 7 * i))
        .map(|t| ((t * 31 + i * 17 + 3) % 250) as u32)
        .collect()
}

fn greedy_body(i: usize) -> Value {
    json!({"prompt": prompt(i), "max_tokens": 8 + i, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_greedy_requests_match_solo_runs() {
    let inst = start("conc", "tiny", |_| {}).await;
    let url = inst.url();
    let mut solo = Vec::new();
    for i in 0..16 {
        let (status, v) = post(&url, "/v1/completions", greedy_body(i)).await;
        assert_eq!(status, 200, "{v}");
        solo.push(token_ids(&v));
    }
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, "/v1/completions", greedy_body(i)).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(token_ids(&v), solo[i], "request {i}");
        assert_eq!(v["usage"]["completion_tokens"], 8 + i);
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// Parses an SSE body: every event is `data: ...`; the last is `[DONE]`.
fn sse_events(body: &str) -> Vec<Value> {
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(
        events.last().map(|e| e.trim()),
        Some("data: [DONE]"),
        "stream must end with [DONE]: {body}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let line = e
                .trim()
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data line: {e:?}"));
            serde_json::from_str(line).unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_non_streaming_give_the_same_text() {
    let inst = start("stream", "tiny", |_| {}).await;
    let url = inst.url();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "The weather today", "max_tokens": 20, "ignore_eos": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 20, "ignore_eos": true}),
        ),
    ] {
        let (status, full) = post(&url, path, body.clone()).await;
        assert_eq!(status, 200, "{full}");
        let chat = path.contains("chat");
        let full_text = if chat {
            full["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        } else {
            full["choices"][0]["text"].as_str().unwrap().to_string()
        };

        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        sbody["stream_options"] = json!({"include_usage": true});
        let r = pdserve_actors::http::http_client()
            .build()
            .unwrap()
            .post(format!("{url}{path}"))
            .json(&sbody)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let events = sse_events(&r.text().await.unwrap());
        let mut text = String::new();
        let mut finish = None;
        for e in &events[..events.len() - 1] {
            let c = &e["choices"][0];
            text.push_str(if chat {
                c["delta"]["content"].as_str().unwrap_or("")
            } else {
                c["text"].as_str().unwrap()
            });
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].as_str().map(str::to_string);
            }
        }
        assert_eq!(text, full_text, "{path}");
        assert_eq!(finish.as_deref(), Some("length"));
        let usage = &events.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], 20);
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(usage[k], full["usage"][k], "{path} {k}");
        }
        // The same prompt a second time: its full blocks come from the prefix cache, and the
        // usage says so.
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached > 0 && cached.is_multiple_of(16) && cached <= prompt_tokens,
            "{path}: {usage}"
        );
        if chat {
            assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        }
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_the_instance_keeps_serving() {
    let inst = start("badinput", "tiny,context=64", |_| {}).await;
    let url = inst.url();
    let long: Vec<u32> = vec![7; 80];
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        (
            "invalid JSON",
            "/v1/completions",
            Value::Null,
            400,
            "invalid JSON",
        ),
        (
            "negative max_tokens",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": -5}),
            400,
            "max_tokens",
        ),
        (
            "fractional max_tokens",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1.5}),
            400,
            "max_tokens",
        ),
        (
            "string max_tokens",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": "ten"}),
            400,
            "max_tokens",
        ),
        (
            "absurd max_tokens",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1_000_000_000u64}),
            400,
            "maximum context length",
        ),
        (
            "zero max_tokens",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}),
            400,
            "at least 1",
        ),
        (
            "unknown model",
            "/v1/completions",
            json!({"model": "gpt-9", "prompt": "a"}),
            400,
            "gpt-9",
        ),
        (
            "prompt longer than context",
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 1}),
            400,
            "maximum context length",
        ),
        (
            "temperature out of range",
            "/v1/completions",
            json!({"prompt": "a", "temperature": 9}),
            400,
            "temperature",
        ),
        (
            "top_p zero",
            "/v1/completions",
            json!({"prompt": "a", "top_p": 0}),
            400,
            "top_p",
        ),
        (
            "negative top_k",
            "/v1/completions",
            json!({"prompt": "a", "top_k": -4}),
            400,
            "top_k",
        ),
        (
            "n above the bound",
            "/v1/completions",
            json!({"prompt": "a", "n": 17}),
            400,
            "`n`",
        ),
        (
            "token id outside vocabulary",
            "/v1/completions",
            json!({"prompt": [1, 2, 999999]}),
            400,
            "vocabulary",
        ),
        (
            "missing prompt",
            "/v1/completions",
            json!({"max_tokens": 3}),
            400,
            "prompt",
        ),
        (
            "messages not a list",
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            400,
            "messages",
        ),
        (
            "empty messages",
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages",
        ),
        (
            "message without content",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}]}),
            400,
            "content",
        ),
        (
            "unknown role",
            "/v1/chat/completions",
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            400,
            "role",
        ),
    ];
    let client = pdserve_actors::http::http_client().build().unwrap();
    for (name, path, body, status, needle) in cases {
        let req = client
            .post(format!("{url}{path}"))
            .header("content-type", "application/json");
        let req = if body.is_null() {
            req.body("{\"prompt\": \"a\",")
        } else {
            req.json(&body)
        };
        let r = req.send().await.unwrap();
        let got = r.status().as_u16();
        let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(got, status, "{name}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(needle),
            "{name}: message {msg:?} should mention {needle:?}"
        );
        assert_eq!(v["error"]["code"], status, "{name}");
    }
    let (status, v) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "still here", "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempted_requests_resume_with_the_same_greedy_tokens() {
    let roomy = start("preempt-ref", "tiny", |_| {}).await;
    let mut solo = Vec::new();
    let body = |i: usize| json!({"prompt": prompt(i + 4), "max_tokens": 40, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    for i in 0..6 {
        let (status, v) = post(&roomy.url(), "/v1/completions", body(i)).await;
        assert_eq!(status, 200, "{v}");
        solo.push(token_ids(&v));
    }
    roomy.stop().await;
    // 16 blocks of 16 tokens cannot hold six sequences of ~70 tokens at once.
    let tight = start("preempt", "tiny", |o| {
        o.num_blocks = Some(16);
        o.watermark = 0.0;
    })
    .await;
    let url = tight.url();
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let (url, b) = (url.clone(), body(i));
            tokio::spawn(async move { post(&url, "/v1/completions", b).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(token_ids(&v), solo[i], "request {i}");
    }
    let stats = tight.stats().await.unwrap();
    assert!(
        stats.preemptions > 0,
        "the pool was meant to be too small: {stats:?}"
    );
    assert_pool_full(&tight).await;
    tight.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_refused_with_503_and_disconnects_free_blocks() {
    let inst = start("overload", "tiny", |o| o.max_concurrent_requests = 1).await;
    let url = inst.url();
    // A long streaming request holds the only admission slot...
    let client = pdserve_actors::http::http_client().build().unwrap();
    let mut long = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 900, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let first = long.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    // ...so the next one is refused...
    let (status, v) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "y", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("overloaded"));
    let s = inst.stats().await.unwrap();
    assert_eq!(s.running, 1);
    // ...until the client goes away: its request is aborted and its blocks come back.
    drop(long);
    assert_pool_full(&inst).await;
    let (status, _) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "y", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_worker_fails_its_requests_is_restarted_and_serves_again() {
    let inst = start("crash", "tiny", |_| {}).await;
    let url = inst.url();
    inst.inject_panic("TpWorker", 0).await.unwrap();
    let (status, v) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "boom", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("worker") && msg.contains("injected fault"),
        "{msg}"
    );
    assert_pool_full(&inst).await;
    // The restarted worker serves the next request.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, v) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "again", "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
        if status == 200 {
            assert_eq!(v["usage"]["completion_tokens"], 5);
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {status} {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let snap = inst.snapshot().await.unwrap();
    let worker = snap.children.iter().find(|c| c.kind == "TpWorker").unwrap();
    assert_eq!(worker.restarts, 1);
    assert!(worker
        .last_error
        .as_deref()
        .unwrap_or("")
        .contains("injected fault"));
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_keeps_crashing_escalates() {
    let mut inst = start("crashloop", "tiny", |o| {
        o.restart_policy = RestartPolicy {
            max_restarts: 2,
            within: Duration::from_secs(60),
        };
    })
    .await;
    let url = inst.url();
    for round in 0..3 {
        // Wait for the worker to be back before crashing it again.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, _) = post(
                &url,
                "/v1/completions",
                json!({"prompt": "ok", "max_tokens": 1}),
            )
            .await;
            if status == 200 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: worker never came back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        inst.inject_panic("TpWorker", 0).await.unwrap();
        let (status, _) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "boom", "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 500, "round {round}");
    }
    // The third crash inside the window spends the budget: the supervisor gives up.
    tokio::time::timeout(Duration::from_secs(10), inst.stopped())
        .await
        .expect("the instance should stop instead of looping");
    assert!(!inst.is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_instance_gives_the_tp1_tokens() {
    let mut results = Vec::new();
    for tp in [1usize, 2] {
        let inst = start(&format!("tp{tp}"), "small", |o| o.tp = tp).await;
        let url = inst.url();
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let url = url.clone();
                tokio::spawn(async move { post(&url, "/v1/completions", greedy_body(i)).await })
            })
            .collect();
        let mut toks = Vec::new();
        for h in handles {
            let (status, v) = h.await.unwrap();
            assert_eq!(status, 200, "{v}");
            toks.push(token_ids(&v));
        }
        assert_pool_full(&inst).await;
        inst.stop().await;
        results.push(toks);
    }
    assert_eq!(results[0], results[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_request_continues_exactly_where_the_original_stopped() {
    let inst = start("resume", "tiny", |_| {}).await;
    let url = inst.url();
    // Greedy, and seeded sampling with penalties: the continuation replays the random stream.
    let bodies = [
        json!({"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
        json!({"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.9, "seed": 11,
               "frequency_penalty": 0.4, "ignore_eos": true, "return_token_ids": true}),
    ];
    for body in bodies {
        let (status, whole) = post(&url, "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{whole}");
        let all = token_ids(&whole);
        assert_eq!(all.len(), 30);
        for cut in [1, 12, 29] {
            let mut b = body.clone();
            b["resume_tokens"] = json!(all[..cut]);
            let (status, rest) = post(&url, "/v1/completions", b.clone()).await;
            assert_eq!(status, 200, "{rest}");
            assert_eq!(token_ids(&rest), all[cut..], "cut {cut}: {body}");
            assert_eq!(
                rest["usage"]["completion_tokens"], 30,
                "counts the resumed tokens"
            );
            // Streamed: the text of the continuation is what the original sent after them.
            b["stream"] = json!(true);
            let r = pdserve_actors::http::http_client()
                .build()
                .unwrap()
                .post(format!("{url}/v1/completions"))
                .json(&b)
                .send()
                .await
                .unwrap();
            let events = sse_events(&r.text().await.unwrap());
            let text: String = events
                .iter()
                .map(|e| e["choices"][0]["text"].as_str().unwrap_or(""))
                .collect();
            assert_eq!(text, rest["choices"][0]["text"].as_str().unwrap());
        }
        // Resumed tokens that already end the request are refused, as is a foreign token.
        let mut b = body.clone();
        b["resume_tokens"] = json!(all);
        let (status, v) = post(&url, "/v1/completions", b).await;
        assert_eq!(status, 400, "{v}");
        let mut b = body.clone();
        b["resume_tokens"] = json!([1_000_000]);
        let (status, v) = post(&url, "/v1/completions", b).await;
        assert_eq!(status, 400, "{v}");
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_separates_live_from_ready_and_a_drain_finishes_what_runs() {
    let inst = start("drain", "tiny", |_| {}).await;
    let url = inst.url();
    let http = pdserve_actors::http::http_client().build().unwrap();
    let get = |path: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let r = http.get(format!("{url}{path}")).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = get("/health").await;
    assert_eq!((status, v["ready"].clone()), (200, json!(true)), "{v}");
    assert_eq!(get("/health/live").await.0, 200);
    // A long request runs while the drain starts.
    let long = {
        let url = url.clone();
        tokio::spawn(async move {
            post(
                &url,
                "/v1/completions",
                json!({"prompt": "x", "max_tokens": 200, "ignore_eos": true}),
            )
            .await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while inst.stats().await.unwrap().running == 0 {
        assert!(Instant::now() < deadline, "the long request never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = http.post(format!("{url}/drain")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    // Draining: live, not ready, new requests refused with 503.
    let (status, v) = get("/health").await;
    assert_eq!(
        (status, v["status"].clone()),
        (503, json!("draining")),
        "{v}"
    );
    assert_eq!(get("/health/ready").await.0, 503);
    assert_eq!(get("/health/live").await.0, 200);
    let (status, v) = post(
        &url,
        "/v1/completions",
        json!({"prompt": "y", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["type"], "shutting_down", "{v}");
    // The owner hears of it, and the stop lets the running request finish.
    tokio::time::timeout(Duration::from_secs(5), inst.drain_requested())
        .await
        .expect("the drain reaches the owner");
    let report = inst.stop().await;
    let (status, v) = long.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 200);
    assert_eq!(report.requests_cut_off, 0, "{report:?}");
    assert!(report.clean(), "{report:?}");
}
