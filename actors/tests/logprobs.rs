//! Logprobs on one colocated instance over HTTP: chat `logprobs`/`top_logprobs`, completions
//! `logprobs: N`, `echo` with prompt logprobs (lm-eval's log-likelihood request), streamed
//! and not, and the 400s of bad values. Every test ends with the block pool full. (The
//! disaggregated cases are in pd.rs.)

mod common;
use common::{assert_pool_full, post, post_to, stream_chunks};

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};

async fn start(name: &str) -> Instance {
    let model = load_model(&ModelSource::Synthetic("small".into())).unwrap();
    Instance::start(InstanceOptions::local(name, model))
        .await
        .unwrap()
}

fn prompt() -> Vec<u32> {
    (0..23).map(|t| (t * 29 + 7) % 250).collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Checks one chat `logprobs.content` entry: top-k probabilities sum to at most 1, sorted,
/// `k` of them, and (greedy, no penalties) the chosen token is the most likely one.
#[track_caller]
fn check_chat_entry(e: &Value, k: usize) {
    let top = e["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), k, "{e}");
    let sum: f64 = top.iter().map(|t| f(&t["logprob"]).exp()).sum();
    assert!(sum <= 1.0 + 1e-6, "top-{k} probabilities sum to {sum}: {e}");
    for w in top.windows(2) {
        assert!(f(&w[0]["logprob"]) >= f(&w[1]["logprob"]), "{e}");
    }
    assert!(f(&e["logprob"]) <= 0.0);
    if k > 0 {
        assert!(
            (f(&e["logprob"]) - f(&top[0]["logprob"])).abs() < 1e-6,
            "greedy picks the most likely token: {e}"
        );
        assert_eq!(e["token"], top[0]["token"], "{e}");
    }
    let bytes = bytes_of(e);
    if let Ok(t) = std::str::from_utf8(&bytes) {
        assert_eq!(t, e["token"].as_str().unwrap(), "{e}");
    }
}

fn bytes_of(e: &Value) -> Vec<u8> {
    e["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completion_logprobs_are_the_models_log_softmax() {
    let inst = start("lp-shapes").await;
    let url = inst.url();
    let chat = json!({"messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 5});
    let (status, v) = post_to(&url, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{v}");
    for e in content {
        check_chat_entry(e, 5);
    }
    // The tokens' bytes join into the answer (a character may span tokens).
    let bytes: Vec<u8> = content.iter().flat_map(bytes_of).collect();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // logprobs: true alone: the chosen token's, no alternatives.
    let mut bare = chat.clone();
    bare.as_object_mut().unwrap().remove("top_logprobs");
    let (status, b) = post_to(&url, "/v1/chat/completions", &bare).await;
    assert_eq!(status, 200, "{b}");
    let bare_content = b["choices"][0]["logprobs"]["content"].as_array().unwrap();
    for (x, y) in bare_content.iter().zip(content) {
        check_chat_entry(x, 0);
        assert_eq!(x["token"], y["token"]);
        assert!((f(&x["logprob"]) - f(&y["logprob"])).abs() < 1e-6);
    }

    // Streamed: each chunk carries its delta's tokens' logprobs; together they are the same.
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let mut got = Vec::new();
    for c in stream_chunks(&url, "/v1/chat/completions", &streamed).await {
        if let Some(items) = c["choices"][0]["logprobs"]["content"].as_array() {
            got.extend(items.iter().cloned());
        }
    }
    assert_eq!(got.len(), content.len(), "{got:?}");
    for (x, y) in got.iter().zip(content) {
        assert_eq!(x["token"], y["token"]);
        assert!((f(&x["logprob"]) - f(&y["logprob"])).abs() < 1e-6);
    }

    // Completions: logprobs N gives the OpenAI legacy shape.
    let body = json!({"prompt": prompt(), "max_tokens": 5, "temperature": 0, "ignore_eos": true, "logprobs": 3});
    let (status, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5, "{v}");
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        // Top 3 plus the chosen token, keyed by text (tokens with one text share a key).
        let top = top.as_object().unwrap();
        assert!((1..=4).contains(&top.len()), "{v}");
        let sum: f64 = top.values().map(|x| f(x).exp()).sum();
        assert!(sum <= 1.0 + 1e-6, "{v}");
        let best = top.values().map(f).fold(f64::NEG_INFINITY, f64::max);
        assert!((f(&lp["token_logprobs"][i]) - best).abs() < 1e-6, "{v}");
        if i + 1 < offsets.len() {
            let len = tokens[i].as_str().unwrap().chars().count() as u64;
            assert_eq!(offsets[i + 1], offsets[i] + len);
        }
    }
    // Without logprobs, `logprobs` stays null.
    let (status, v) = post(&url, &json!({"prompt": prompt(), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_as_lm_eval_asks() {
    let inst = start("lp-echo").await;
    let url = inst.url();
    let p = prompt();
    // lm-eval's log-likelihood request: echo, max_tokens 0, logprobs 1.
    let body = json!({"prompt": p, "echo": true, "max_tokens": 0, "logprobs": 1, "temperature": 0});
    let (status, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let n = p.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n, "{v}");
    assert!(lp["token_logprobs"][0].is_null(), "{v}");
    assert!(lp["top_logprobs"][0].is_null(), "{v}");
    for i in 1..n {
        let x = f(&lp["token_logprobs"][i]);
        assert!(x <= 0.0);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((1..=2).contains(&top.len()), "{v}");
        assert!(top.values().map(|x| f(x).exp()).sum::<f64>() <= 1.0 + 1e-6);
    }
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    let echoed: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), echoed, "{v}");

    // The same prompt with one generated token: the prompt part is identical, the next token
    // follows (lm-eval's older form, max_tokens 1, drops the last entry).
    let mut one = body.clone();
    one["max_tokens"] = json!(1);
    let (status, w) = post(&url, &one).await;
    assert_eq!(status, 200, "{w}");
    let lw = &w["choices"][0]["logprobs"];
    assert_eq!(lw["tokens"].as_array().unwrap().len(), n + 1, "{w}");
    for i in 1..n {
        assert!((f(&lw["token_logprobs"][i]) - f(&lp["token_logprobs"][i])).abs() < 1e-5);
    }
    // Scoring the prompt's last token equals the first generated token's logprob when that
    // token is appended: the prompt logprob of p + [t] at t is t's logprob after p.
    let mut longer = p.clone();
    let gen = {
        let (s, g) = post(
            &url,
            &json!({"prompt": p, "max_tokens": 1, "temperature": 0, "return_token_ids": true}),
        )
        .await;
        assert_eq!(s, 200, "{g}");
        g["choices"][0]["token_ids"][0].as_u64().unwrap() as u32
    };
    longer.push(gen);
    let (status, l) = post(
        &url,
        &json!({"prompt": longer, "echo": true, "max_tokens": 0, "logprobs": 0}),
    )
    .await;
    assert_eq!(status, 200, "{l}");
    assert!(
        (f(&l["choices"][0]["logprobs"]["token_logprobs"][n]) - f(&lw["token_logprobs"][n])).abs()
            < 1e-4,
        "{l} vs {w}"
    );

    // Streamed echo: the prompt (and its logprobs) comes first, then nothing generated.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(&url, "/v1/completions", &streamed).await;
    assert_eq!(
        chunks[0]["choices"][0]["text"], v["choices"][0]["text"],
        "{chunks:?}"
    );
    assert_eq!(chunks[0]["choices"][0]["logprobs"], *lp, "{chunks:?}");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{chunks:?}");
    assert_eq!(last["choices"][0]["text"], "", "{chunks:?}");

    // Echo without logprobs: the prompt's text leads the answer.
    let (status, e) = post(
        &url,
        &json!({"prompt": "hello there", "echo": true, "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{e}");
    assert!(
        e["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("hello there"),
        "{e}"
    );
    assert!(e["choices"][0]["logprobs"].is_null(), "{e}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_logprobs_values_are_400s_naming_the_field() {
    let inst = start("lp-bad").await;
    let url = inst.url();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "logprobs": 5}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "echo": true}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": -1}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": true}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
    ];
    for (path, body, field) in cases {
        let (status, v) = post_to(&url, path, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(&format!("`{field}`")), "{body}: {msg}");
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}
