//! Hostile requests over HTTP: values chosen to overflow arithmetic or to poison a batch are
//! refused with a 400 before they reach the Scheduler, the handler does not panic, the
//! instance keeps serving and its block pool returns to full.

mod common;
use common::{assert_pool_full, get_json, post};

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::time::Duration;

async fn start(name: &str, transfer: Option<BackendKind>) -> Instance {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic("tiny".into())).unwrap(),
    );
    o.transfer = transfer.map(|b| TransferConfig::new(b, name));
    Instance::start(o).await.unwrap()
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

/// A client of the peer protocol without cluster credentials or key (it calls over HTTP).
fn stranger() -> std::sync::Arc<pdserve_actors::handoff::peer::Peers> {
    pdserve_actors::handoff::peer::Peers::new(
        "hostile-test".into(),
        None,
        None,
        None,
        Duration::from_secs(30),
        pdserve_actors::http::http_client(),
    )
}

/// A fake prefill instance on the HTTP carrier: answers any request with a 200 whose body
/// never ends (chunked, up to `limit` bytes) or declares `declared` bytes up front.
async fn endless_peer(
    declared: Option<u64>,
    limit: usize,
) -> (String, tokio::task::JoinHandle<usize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = sock.read(&mut buf).await.unwrap();
            if n == 0 {
                return 0;
            }
            head.extend_from_slice(&buf[..n]);
        }
        let framing = match declared {
            Some(n) => format!("content-length: {n}"),
            None => "transfer-encoding: chunked".to_string(),
        };
        let header = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n{framing}\r\n\r\n"
        );
        if sock.write_all(header.as_bytes()).await.is_err() {
            return 0;
        }
        let chunk = vec![0x41u8; 1 << 20];
        let mut sent = 0;
        while sent < limit {
            let res = if declared.is_some() {
                sock.write_all(&chunk).await
            } else {
                let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
                framed.extend_from_slice(&chunk);
                framed.extend_from_slice(b"\r\n");
                sock.write_all(&framed).await
            };
            if res.is_err() {
                break; // the client hung up: what we want
            }
            sent += chunk.len();
        }
        sent
    });
    (url, task)
}

/// A peer answer over HTTP is read up to the control plane's frame limit and refused past
/// it, whether it declares its length or streams without end: a fake prefill cannot stream
/// gigabytes into a decode instance's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_peer_answer_is_cut_off_at_the_frame_limit() {
    use pdserve_actors::handoff::peer::{PeerAddr, MAX_HTTP_ANSWER_BYTES};
    use pdserve_actors::handoff::protocol::{HandoffError, PeerRequest};
    let peers = stranger();
    for declared in [None, Some(1u64 << 40)] {
        // The fake sends at most 4x the limit, so the test ends even if nothing cuts it off.
        let (url, server) = endless_peer(declared, 4 * MAX_HTTP_ANSWER_BYTES).await;
        let err = peers
            .call(
                &PeerAddr::Http { url },
                &PeerRequest::Info,
                Duration::from_secs(60),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, HandoffError::Protocol(m) if m.contains("more than")),
            "declared {declared:?}: {err:?}"
        );
        let sent = tokio::time::timeout(Duration::from_secs(30), server)
            .await
            .expect("the fake peer stops once the client hangs up")
            .unwrap();
        assert!(
            sent < 2 * MAX_HTTP_ANSWER_BYTES,
            "declared {declared:?}: the client kept reading ({sent} bytes sent)"
        );
    }
}

/// The token ids of a streamed completion (`return_token_ids`), in order: `first`, then the
/// rest of `r`.
async fn streamed_ids(first: &[u8], mut r: reqwest::Response) -> Vec<u64> {
    let mut text = String::from_utf8_lossy(first).into_owned();
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .flat_map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["choices"][0]["token_ids"]
                .as_array()
                .map(|a| a.iter().map(|t| t.as_u64().unwrap()).collect::<Vec<_>>())
                .unwrap_or_default()
        })
        .collect()
}

/// One request can never fail another: hostile requests sent while seven good ones decode in
/// one batch are each refused with a 400 naming the field, and the seven finish
/// token-for-token as they do alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_beside_a_batch_leave_it_token_identical() {
    let inst = start("d-batch", Some(BackendKind::Local)).await;
    let url = inst.url();
    let good = |i: u32| {
        json!({"prompt": [5 + i, 6, 7 + 2 * i, 8], "max_tokens": 400, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true})
    };
    let mut alone = Vec::new();
    for i in 0..7 {
        let (status, v) = post(&url, &good(i)).await;
        assert_eq!(status, 200, "{v}");
        alone.push(
            v["choices"][0]["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect::<Vec<_>>(),
        );
    }
    let client = pdserve_actors::http::http_client().build().unwrap();
    // The seven start streaming: once each has sent a chunk they all run in the batch.
    let mut streams = Vec::new();
    for i in 0..7 {
        let mut body = good(i);
        body["stream"] = json!(true);
        let mut r = client
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let first = r.chunk().await.unwrap().unwrap();
        streams.push((first, r));
    }
    let addr = url.trim_start_matches("http://").to_string();
    let (host, port) = addr.rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let too_long: Vec<u32> = vec![5; 4096];
    let hostile = [
        (
            "prompt id",
            json!({"prompt": [5, 4_000_000_000u64], "max_tokens": 4}),
            "vocabulary",
        ),
        (
            "max_tokens wrap",
            json!({"prompt": [5, 6], "max_tokens": u64::MAX}),
            "context length",
        ),
        (
            "negative max_tokens",
            json!({"prompt": [5, 6], "max_tokens": -1}),
            "max_tokens",
        ),
        (
            "context",
            json!({"prompt": too_long, "max_tokens": 4}),
            "context length",
        ),
        (
            "stop id",
            json!({"prompt": [5, 6], "stop_token_ids": [4_000_000]}),
            "stop_token_ids",
        ),
        (
            "stop ids",
            json!({"prompt": [5, 6], "stop_token_ids": vec![3u32; 100_000]}),
            "stop_token_ids",
        ),
        (
            "temperature",
            json!({"prompt": [5, 6], "temperature": 1e30}),
            "temperature",
        ),
        (
            "resume",
            json!({"prompt": [5, 6], "resume_tokens": [4_000_000_000u64]}),
            "resume_tokens",
        ),
        (
            "first token",
            json!({"prompt": [5, 6, 7, 8], "max_tokens": 4, "kv_transfer_params": {
            "do_remote_prefill": true, "remote_host": host, "remote_port": port,
            "remote_block_ids": [0], "first_token_id": 4_000_000_000u64,
            "transfer_id": TransferId::new_random().to_string()}}),
            "first_token_id",
        ),
    ];
    let refusals: Vec<_> = hostile
        .into_iter()
        .map(|(name, body, needle)| {
            let url = url.clone();
            tokio::spawn(async move { (name, needle, post(&url, &body).await) })
        })
        .collect();
    for r in refusals {
        let (name, needle, (status, v)) = r.await.unwrap();
        assert_eq!(status, 400, "{name}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(needle),
            "{name}: {msg:?} should name {needle:?}"
        );
    }
    for (i, (first, rest)) in streams.into_iter().enumerate() {
        let ids = streamed_ids(&first, rest).await;
        assert_eq!(ids, alone[i], "request {i} changed beside the hostile ones");
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// The peer protocol's HTTP carrier: on an instance with cluster credentials it is off (the
/// protocol runs on the mutual-TLS control plane); without them, a push request cannot aim
/// the prefill instance's writes at another host than the caller's; and a caller naming ever
/// new initiators cannot grow the grant map past its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_peer_carrier_is_bounded_to_its_callers() {
    use pdserve_actors::handoff::peer::PeerAddr;
    use pdserve_actors::handoff::protocol::{
        HandoffError, PeerAnswer, PeerRequest, PrefillMode, PrefillRequest,
    };
    use pdserve_actors::handoff::session::MAX_GRANTS;
    let peers = stranger();

    // A credentialed prefill instance refuses the HTTP carrier with a 403 that says why.
    let cluster =
        pdserve_transport::control::tls::ClusterCredentials::ephemeral("hostile").unwrap();
    let mut o = InstanceOptions::local(
        "p-creds",
        load_model(&ModelSource::Synthetic("tiny".into())).unwrap(),
    );
    o.transfer = Some(TransferConfig::new(BackendKind::Tcp, "p-creds"));
    o.control = Some(pdserve_actors::control_plane::InstanceControl::new(
        cluster.issue("p-creds").unwrap(),
        pdserve_runtime::Role::Prefill,
    ));
    let creds = Instance::start(o).await.unwrap();
    let url = creds.url();
    let err = peers
        .call(
            &PeerAddr::Http { url: url.clone() },
            &PeerRequest::Info,
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("403") && err.to_string().contains("control plane"),
        "{err}"
    );
    // ...and names its control address for peers that know only its URL.
    let info = get_json(&url, "/v1/kv/info").await;
    assert!(info["control_addr"].is_string(), "{info}");
    creds.stop().await;

    // Without credentials (from loopback): a push to another host is refused before any
    // prompt runs.
    let p = start("p-plain", Some(BackendKind::Tcp)).await;
    let at = PeerAddr::Http { url: p.url() };
    let PeerAnswer::Info(mut theirs) = peers
        .call(&at, &PeerRequest::Info, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("no Info answer")
    };
    theirs.transfer_addr = "10.213.7.9:7000".into();
    let push = PeerRequest::Prefill(PrefillRequest {
        transfer: TransferId::new_random(),
        prompt: vec![5, 6, 7, 8],
        sampling: pdserve_gpu::sampling::SamplingParams::greedy(1),
        mode: PrefillMode::Push {
            peer: theirs,
            block_ids: vec![0],
            session: None,
        },
        cached_blocks: 0,
    });
    match peers
        .call(&at, &push, Duration::from_secs(30))
        .await
        .unwrap()
    {
        PeerAnswer::Failed(HandoffError::BadRequest(m)) => {
            assert!(m.contains("not on the host the request came from"), "{m}")
        }
        other => panic!("a push to another host was not refused: {other:?}"),
    }
    // Initiators beyond the bound are refused, not remembered.
    let mut refused = None;
    for i in 0..=MAX_GRANTS {
        let open = PeerRequest::OpenSession {
            initiator: format!("stranger-{i}"),
            fresh: false,
        };
        match peers
            .call(&at, &open, Duration::from_secs(30))
            .await
            .unwrap()
        {
            PeerAnswer::Session(_) => {}
            PeerAnswer::Failed(e) => {
                refused = Some((i, e));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let (i, e) = refused.expect("the grant map grew past its bound");
    assert_eq!(i, MAX_GRANTS, "refused early: {e}");
    assert!(matches!(e, HandoffError::Overloaded(_)), "{e}");
    assert_serves(&p.url()).await;
    assert_pool_full(&p).await;
    p.stop().await;
}
