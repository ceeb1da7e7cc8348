//! Hostile requests over HTTP: values chosen to overflow arithmetic or to poison a batch are
//! refused with a 400 before they reach the Scheduler, the handler does not panic, the
//! instance keeps serving and its block pool returns to full.

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn start(name: &str, transfer: Option<BackendKind>) -> Instance {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic("tiny".into())).unwrap(),
    );
    o.transfer = transfer.map(|b| TransferConfig::new(b, name));
    Instance::start(o).await.unwrap()
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{url}/v1/completions"))
        .json(body)
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

async fn assert_pool_full(inst: &Instance) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = inst.stats().await.unwrap();
        if s.blocks_free == s.blocks_total && s.running == 0 && s.waiting == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "pool not back to full: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A good request answers with `max_tokens` tokens: the instance still serves.
async fn assert_serves(url: &str) {
    let (status, v) = post(
        url,
        &json!({"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
}

/// `max_tokens` whose sum with the prompt length wraps a u64: once accepted and run to the
/// context limit, once a handler panic (a zero-sized event channel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_that_wrap_the_context_check_are_refused() {
    let inst = start("wrap", None).await;
    let url = inst.url();
    for n in [u64::MAX, u64::MAX - 3] {
        for body in [
            json!({"prompt": "hi", "max_tokens": n, "ignore_eos": true}),
            json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": n}),
        ] {
            let (status, v) = post(&url, &body).await;
            assert_eq!(status, 400, "max_tokens {n}: {v}");
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(
                msg.contains("maximum context length"),
                "max_tokens {n}: the error names the context limit: {v}"
            );
        }
    }
    assert_serves(&url).await;
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// A decode request whose `kv_transfer_params.first_token_id` lies outside the vocabulary
/// is refused before it joins a decode batch (where it would fail every request of it); the
/// Scheduler checks it on admission (a regression test: this already held at a295952).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_first_token_is_refused_before_the_batch() {
    let inst = start("d-forged", Some(BackendKind::Local)).await;
    let url = inst.url();
    let addr = url.trim_start_matches("http://").to_string();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let (status, v) = post(
        &url,
        &json!({
            "prompt": [5, 6, 7, 8],
            "max_tokens": 4,
            "kv_transfer_params": {
                "do_remote_prefill": true,
                "remote_host": host,
                "remote_port": port.parse::<u16>().unwrap(),
                "remote_block_ids": [0],
                "first_token_id": 4_000_000_000u64,
                "transfer_id": TransferId::new_random().to_string(),
            }
        }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("first_token_id") && msg.contains("vocabulary"),
        "{v}"
    );
    assert_serves(&url).await;
    assert_pool_full(&inst).await;
    inst.stop().await;
}
