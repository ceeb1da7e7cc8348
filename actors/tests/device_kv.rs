//! CUDA ranks in the actors, without a GPU: instances whose ranks run the CPU stand-in of
//! the CUDA executor (`pdserve_actors::worker::standin`), which keeps its KV cache private
//! (the "device") and exposes only a host mirror to the transfer engine. Prefill writes
//! through to the mirror before each layer is reported; decode receives into the mirror and
//! must upload the landed blocks before its first step. Under greedy sampling a P/D hand-off
//! must give the tokens of a colocated CPU instance; a decode side that skips the upload must
//! not (so these tests can fail); a failed upload fails only its request; a lost device
//! restarts the rank. Every block pool returns to full.

mod common;
use common::{assert_pool_full, post};

use pdserve_actors::handoff::TransferMode;
use pdserve_actors::proxy::{start_proxy, ProxyArgs};
use pdserve_actors::worker::{KvMirror, RankDevice, StandInFaults};
use pdserve_actors::{Instance, InstanceOptions, StartError};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every test ends within this bound.
const TEST_BOUND: Duration = Duration::from_secs(180);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("the test ran past its bound");
}

fn options(name: &str, device: RankDevice, transfer: Option<BackendKind>) -> InstanceOptions {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic("small".into())).unwrap(),
    );
    o.num_blocks = Some(128);
    o.device = device;
    o.transfer = transfer.map(|b| TransferConfig::new(b, name));
    o
}

async fn start(name: &str, device: RankDevice, transfer: Option<BackendKind>) -> Instance {
    Instance::start(options(name, device, transfer))
        .await
        .unwrap()
}

fn stand_in(mirror: KvMirror, faults: &Arc<StandInFaults>) -> RankDevice {
    RankDevice::StandIn {
        mirror,
        faults: faults.clone(),
    }
}

/// Greedy tokens of `common::greedy_body(0..n)` from a colocated instance on `device`.
async fn colocated(name: &str, device: RankDevice, n: usize) -> Vec<Vec<u64>> {
    let c = start(name, device, None).await;
    let mut out = Vec::new();
    for i in 0..n {
        let (status, v) = post(&c.url(), &common::greedy_body(i)).await;
        assert_eq!(status, 200, "{v}");
        out.push(common::token_ids(&v));
    }
    assert_pool_full(&c).await;
    c.stop().await;
    out
}

/// vLLM's two hops (prefill with `max_tokens: 1`, then decode with the prefill answer's
/// `kv_transfer_params`: a pull of the held blocks); the decode side's answer.
async fn via_pd(prefill: &str, decode: &str, original: &Value) -> (u16, Value) {
    let mut p = original.clone();
    p["max_tokens"] = json!(1);
    p["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, answer) = post(prefill, &p).await;
    assert_eq!(status, 200, "prefill: {answer}");
    let mut d = original.clone();
    d["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    post(decode, &d).await
}

/// A prefill (write-through) and a decode (receive) instance on the stand-in.
struct Pair {
    p: Instance,
    d: Instance,
    d_faults: Arc<StandInFaults>,
}

impl Pair {
    async fn start(tag: &str, backend: BackendKind, d_tp: usize, mode: TransferMode) -> Self {
        let p_faults = StandInFaults::new();
        let d_faults = StandInFaults::new();
        let mut po = options(
            &format!("p-{tag}"),
            stand_in(KvMirror::WriteThrough, &p_faults),
            Some(backend),
        );
        // Chunks of 24 tokens end inside blocks of 16: layerwise pushes of partial blocks.
        po.max_num_batched_tokens = 24;
        let mut d = options(
            &format!("d-{tag}"),
            stand_in(KvMirror::Receive, &d_faults),
            Some(backend),
        );
        d.tp = d_tp;
        d.transfer_mode = mode;
        let p = Instance::start(po).await.unwrap();
        let d = Instance::start(d).await.unwrap();
        Self { p, d, d_faults }
    }

    async fn stop(self) {
        assert_pool_full(&self.p).await;
        assert_pool_full(&self.d).await;
        self.p.stop().await;
        self.d.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_kv_hand_offs_match_colocated_in_pull_and_push() {
    bounded(async {
        let n = 4;
        let reference = colocated("ref-cpu", RankDevice::Cpu, n).await;
        // The stand-in computes what the CPU backend does (its cache is just elsewhere).
        let faults = StandInFaults::new();
        let alone = colocated("ref-standin", stand_in(KvMirror::Off, &faults), n).await;
        assert_eq!(alone, reference, "colocated stand-in");

        // Pull (vLLM's two hops) over tcp: decode reads prefill's mirror into its own.
        let pair = Pair::start("pull", BackendKind::Tcp, 1, TransferMode::Pull).await;
        let answers: Vec<_> = (0..n)
            .map(|i| {
                let (pu, du) = (pair.p.url(), pair.d.url());
                tokio::spawn(async move { via_pd(&pu, &du, &common::greedy_body(i)).await })
            })
            .collect();
        for (i, h) in answers.into_iter().enumerate() {
            let (status, v) = h.await.unwrap();
            assert_eq!(status, 200, "pull request {i}: {v}");
            assert_eq!(common::token_ids(&v), reference[i], "pull request {i}");
        }
        assert!(
            pair.d_faults.uploads_done() >= n as u64,
            "every hand-off was uploaded: {}",
            pair.d_faults.uploads_done()
        );
        // Again: decode's prefix cache now holds the prompt's leading blocks (on its device),
        // so only the rest moves and is uploaded; the cached blocks must not be overwritten
        // from the mirror.
        let (status, v) = via_pd(&pair.p.url(), &pair.d.url(), &common::greedy_body(n - 1)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            common::token_ids(&v),
            reference[n - 1],
            "with a cached prefix"
        );
        pair.stop().await;

        // Push (decode drives, prefill writes each layer once its mirror copy is done) into
        // a decode instance of two ranks: each rank uploads its own heads.
        let pair = Pair::start("push", BackendKind::Shm, 2, TransferMode::Push).await;
        let mut args = ProxyArgs::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![pair.p.url()],
            vec![pair.d.url()],
        );
        args.migration_limit = 0;
        args.prefill_retry = pdserve_runtime::config::PrefillRetry::Fail;
        let proxy = start_proxy("proxy-device-kv", args).await.unwrap();
        let url = format!("http://{}", proxy.addr);
        // The proxy routes once its health checks found both instances.
        common::wait_for_health(
            &url,
            Duration::from_secs(10),
            "the proxy never became healthy",
            |h| h["status"] == "ok",
        )
        .await;
        for (i, want) in reference.iter().enumerate() {
            let (status, v) = post(&url, &common::greedy_body(i)).await;
            assert_eq!(status, 200, "push request {i}: {v}");
            assert_eq!(&common::token_ids(&v), want, "push request {i}");
        }
        let (pf, df) = (pair.p.kv_figures().unwrap(), pair.d.kv_figures().unwrap());
        assert!(pf.bytes_sent > 0 && df.failures == 0, "{pf:?} {df:?}");
        assert!(
            pair.d_faults.uploads_done() >= 2 * n as u64,
            "two ranks upload"
        );
        proxy.stop().await;
        pair.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_upload_fails_only_its_request_and_a_skipped_one_changes_the_tokens() {
    bounded(async {
        let reference = colocated("ref-upload", RankDevice::Cpu, 3).await;
        let pair = Pair::start("upload", BackendKind::Tcp, 1, TransferMode::Pull).await;

        // The upload of the first hand-off fails: that request fails like a failed transfer
        // (502, naming the upload), its blocks go back, and the instance keeps serving.
        pair.d_faults.fail_next_uploads(1);
        let (status, v) = via_pd(&pair.p.url(), &pair.d.url(), &common::greedy_body(0)).await;
        assert_eq!(status, 502, "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("upload to the device failed") && msg.contains("injected"),
            "{v}"
        );
        assert_pool_full(&pair.d).await;
        let (status, v) = via_pd(&pair.p.url(), &pair.d.url(), &common::greedy_body(1)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(common::token_ids(&v), reference[1]);

        // Without the upload the decode steps read whatever the device held for those blocks:
        // the tokens differ, so the comparisons above can fail.
        pair.d_faults.skip_uploads(true);
        let (status, v) = via_pd(&pair.p.url(), &pair.d.url(), &common::greedy_body(2)).await;
        assert_eq!(status, 200, "{v}");
        assert_ne!(
            common::token_ids(&v),
            reference[2],
            "decoding without the upload"
        );
        pair.d_faults.skip_uploads(false);
        // A receive-only mirror has nothing to hand on: holding KV for a peer is refused.
        let mut held = common::greedy_body(0);
        held["max_tokens"] = json!(1);
        held["kv_transfer_params"] = json!({"do_remote_decode": true});
        let (status, v) = post(&pair.d.url(), &held).await;
        assert_eq!(status, 400, "{v}");
        assert!(
            v.to_string()
                .contains("without a host mirror peers can read"),
            "{v}"
        );
        let (status, v) = via_pd(&pair.p.url(), &pair.d.url(), &common::greedy_body(0)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(common::token_ids(&v), reference[0]);
        pair.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_restarts_the_rank_and_the_instance_serves_again() {
    bounded(async {
        let faults = StandInFaults::new();
        let c = start("lost-device", stand_in(KvMirror::Off, &faults), None).await;
        let (status, v) = post(&c.url(), &common::greedy_body(1)).await;
        assert_eq!(status, 200, "{v}");
        let want = common::token_ids(&v);
        assert_eq!(faults.executors_started(), 1);

        faults.lose_device();
        let (status, v) = post(&c.url(), &common::greedy_body(1)).await;
        assert!(
            status >= 500,
            "the step on the lost device fails: {status} {v}"
        );
        // The worker stops on the device error; its supervisor starts a fresh executor.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, v) = post(&c.url(), &common::greedy_body(1)).await;
            if status == 200 {
                assert_eq!(common::token_ids(&v), want, "after the restart");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "never served again: {status} {v}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(faults.executors_started(), 2, "one restart");
        assert_pool_full(&c).await;
        c.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_kv_refuses_the_kv_tiers_and_a_transfer_engine_without_a_mirror() {
    bounded(async {
        let faults = StandInFaults::new();
        let config_key = |r: Result<Instance, StartError>| match r {
            Err(StartError::Config { key, message }) => (key, message),
            Err(e) => panic!("not a config error: {e}"),
            Ok(_) => panic!("started"),
        };
        let mut o = options("tiers-on-device", stand_in(KvMirror::Off, &faults), None);
        o.kv_tiers = Some(pdserve_actors::kv_tiers::TierSettings::host_only(1 << 20));
        let (key, message) = config_key(Instance::start(o).await);
        assert_eq!(key, "kv_tiers", "{message}");
        assert!(message.contains("device"), "{message}");

        let o = options(
            "engine-without-mirror",
            stand_in(KvMirror::Off, &faults),
            Some(BackendKind::Local),
        );
        let (key, message) = config_key(Instance::start(o).await);
        assert_eq!(key, "instance.role", "{message}");
        assert!(message.contains("mirror"), "{message}");
        assert_eq!(
            faults.executors_started(),
            0,
            "refused before any rank started"
        );
    })
    .await;
}
