//! What the actors' integration tests share: one request, and the pool check every test ends
//! with. (Each test binary uses part of it.)
#![allow(dead_code)]

use pdserve_actors::Instance;
use serde_json::Value;
use std::time::{Duration, Instant};

/// `POST /v1/completions` with `body`: the status and the answer (as JSON, or as a string when
/// it is not JSON).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    post_to(url, "/v1/completions", body).await
}

/// `POST {path}` with `body`.
async fn send(url: &str, path: &str, body: &Value) -> reqwest::Response {
    pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// `POST {path}` with `body`, as [`post`].
pub async fn post_to(url: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = send(url, path, body).await;
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// `POST {path}` with `body` (which asks `stream: true`): the JSON chunks of the SSE answer,
/// `[DONE]` left out.
pub async fn stream_chunks(url: &str, path: &str, body: &Value) -> Vec<Value> {
    let text = send(url, path, body).await.text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Polls the proxy at `url`'s `GET /health` every 50 ms until `ready` accepts its answer;
/// panics naming `what` with the last answer after `within`.
pub async fn wait_for_health(
    url: &str,
    within: std::time::Duration,
    what: &str,
    ready: impl Fn(&Value) -> bool,
) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let h = get_json(url, "/health").await;
        if ready(&h) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} within {within:?}: {h}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `GET {path}` at `url`, as JSON.
pub async fn get_json(url: &str, path: &str) -> Value {
    let text = get_text(url, path).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `GET {path}` at `url`, as text (`/metrics`).
pub async fn get_text(url: &str, path: &str) -> String {
    pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .get(format!("{url}{path}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The token ids of a choice (`return_token_ids`), as a whole answer or a streamed chunk has
/// them.
fn token_ids_of(choice: &Value) -> impl Iterator<Item = u64> + '_ {
    choice["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {choice}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
}

/// The first choice's token ids of a whole answer (`return_token_ids`).
pub fn token_ids(v: &Value) -> Vec<u64> {
    token_ids_of(&v["choices"][0]).collect()
}

/// Request `i` of the P/D token-identity tests: a distinct prompt of `6 + 9i` token ids below
/// 250, `12 + i` greedy tokens, EOS ignored, token ids returned.
pub fn greedy_body(i: usize) -> Value {
    let prompt: Vec<u32> = (0..(6 + 9 * i))
        .map(|t| ((t * 37 + i * 11 + 5) % 250) as u32)
        .collect();
    serde_json::json!({"prompt": prompt, "max_tokens": 12 + i, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

/// Each choice's token ids of a whole answer, checking the indices are 0.. in order.
pub fn choice_token_ids(v: &Value) -> Vec<Vec<u64>> {
    let choices = v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("no choices: {v}"));
    choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], serde_json::json!(i), "{v}");
            token_ids_of(c).collect()
        })
        .collect()
}

/// Each of `n` choices' token ids gathered from streamed chunks (by their `index`; chunks
/// without a choice, the usage chunk, are skipped).
pub fn streamed_choice_token_ids(chunks: &[Value], n: usize) -> Vec<Vec<u64>> {
    let mut ids = vec![Vec::new(); n];
    for choice in chunks
        .iter()
        .map(|c| &c["choices"][0])
        .filter(|c| c.is_object())
    {
        let i = choice["index"].as_u64().unwrap() as usize;
        ids[i].extend(token_ids_of(choice));
    }
    ids
}

/// Waits (at most 10 s) until nothing runs or waits at `inst` and every KV block is free again.
pub async fn assert_pool_full(inst: &Instance) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = inst.stats().await.unwrap();
        if s.blocks_in_use == 0
            && s.blocks_free == s.blocks_total
            && s.running == 0
            && s.waiting == 0
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} pool not back to full: {s:?}",
            inst.model_name()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
