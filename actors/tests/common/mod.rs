//! What the actors' integration tests share: one request, and the pool check every test ends
//! with. (Each test binary uses part of it.)
#![allow(dead_code)]

use pdserve_actors::Instance;
use serde_json::Value;
use std::time::{Duration, Instant};

/// `POST /v1/completions` with `body`: the status and the answer (as JSON, or as a string when
/// it is not JSON).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
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
