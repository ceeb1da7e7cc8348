//! The prefix cache and delta KV transfer between in-process instances (issue 12).
//!
//! Under greedy sampling, output with the prefix cache on must be token-identical to output
//! with it off: colocated, 1P1D pull, 1P1D push, 1P2D, and prefill tp=1 → decode tp=3, over a
//! workload of prompts sharing prefixes that end mid-block, whole-prompt repeats, extended
//! prompts (a second turn) and requests racing on the same prefix. A 2-turn chat moves only
//! the new blocks; a small pool forced to evict during hand-offs still answers exactly and
//! returns to full.

mod common;
use common::{assert_pool_full, post};

use pdserve_actors::control_plane::InstanceControl;
use pdserve_actors::handoff::TransferMode;
use pdserve_actors::proxy::{start_proxy, ProxyArgs, StartedProxy};
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_transport::{BackendKind, TransferConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const SMALL: &str = "small";
/// Three KV heads: decode can run tp=3.
const TP3: &str = "small,heads=6,kv_heads=3,hidden=192,ffn=384,vocab=321";
const BLOCK: usize = 8;

fn cluster() -> &'static pdserve_transport::control::tls::ClusterCredentials {
    static CLUSTER: std::sync::OnceLock<pdserve_transport::control::tls::ClusterCredentials> =
        std::sync::OnceLock::new();
    CLUSTER.get_or_init(|| {
        pdserve_transport::control::tls::ClusterCredentials::ephemeral("prefix-test").unwrap()
    })
}

/// An instance named `ROLE-…` (`p`, `d` or anything else for colocated).
async fn instance(
    name: &str,
    spec: &str,
    tp: usize,
    transfer: Option<BackendKind>,
    tweak: impl FnOnce(&mut InstanceOptions),
) -> Instance {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic(spec.into())).unwrap(),
    );
    o.tp = tp;
    o.block_size = BLOCK;
    o.num_blocks = Some(512);
    let role = match name.split('-').next() {
        Some("p") => pdserve_runtime::Role::Prefill,
        Some("d") => pdserve_runtime::Role::Decode,
        _ => pdserve_runtime::Role::Colocated,
    };
    if transfer.is_some() {
        o.control = Some(InstanceControl::new(cluster().issue(name).unwrap(), role));
    }
    o.transfer = transfer.map(|b| {
        let mut c = TransferConfig::new(b, name);
        c.require_auth = b != BackendKind::Local;
        c
    });
    tweak(&mut o);
    Instance::start(o).await.unwrap()
}

fn request(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

fn tokens(n: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|t| ((t * 37 + seed * 101 + 5) % 250) as u32)
        .collect()
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// Waves of prompts: each wave is sent at once (racing), waves one after another (so later
/// waves find earlier prompts' blocks cached).
fn workload() -> Vec<Vec<Vec<u32>>> {
    // A shared system prompt ending mid-block (37 = 4 blocks + 5 tokens).
    let system = tokens(37, 1);
    let a = cat(&[&system, &tokens(10, 2)]);
    let b = cat(&[&system, &tokens(7, 3)]);
    // A second turn: the first turn's prompt extended.
    let a2 = cat(&[&a, &tokens(21, 4)]);
    // A prompt of exactly whole blocks (its last token must still be computed).
    let whole = tokens(5 * BLOCK, 5);
    // Another prefix that two requests race on.
    let race = cat(&[&tokens(30, 6), &tokens(3, 7)]);
    vec![
        vec![a.clone()],
        vec![b.clone(), a.clone()],
        vec![a2.clone(), whole.clone(), race.clone(), race.clone()],
        vec![whole.clone(), a2.clone(), b.clone()],
        vec![cat(&[&race, &tokens(9, 8)]), cat(&[&race, &tokens(9, 9)])],
    ]
}

const MAX_TOKENS: usize = 6;

/// Runs the workload against `url`; returns the token ids, in workload order.
async fn run_workload(url: &str) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for wave in workload() {
        let handles: Vec<_> = wave
            .into_iter()
            .map(|p| {
                let url = url.to_string();
                tokio::spawn(async move { post(&url, &request(&p, MAX_TOKENS)).await })
            })
            .collect();
        for h in handles {
            let (status, v) = h.await.unwrap();
            assert_eq!(status, 200, "{v}");
            out.push(common::token_ids(&v));
        }
    }
    out
}

fn next_tag() -> usize {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The workload on one colocated instance.
async fn colocated(spec: &str, prefix_cache: bool) -> Vec<Vec<u64>> {
    let c = instance(
        &format!("c-{}-{}", prefix_cache, next_tag()),
        spec,
        1,
        None,
        |o| {
            o.prefix_cache = prefix_cache;
            o.max_num_batched_tokens = 24;
        },
    )
    .await;
    let out = run_workload(&c.url()).await;
    let s = c.stats().await.unwrap();
    if prefix_cache {
        assert!(s.prompt_tokens_cached > 0, "the cache was used: {s:?}");
    } else {
        assert_eq!(s.prompt_tokens_cached, 0, "{s:?}");
        assert_eq!(s.blocks_cached, 0, "{s:?}");
    }
    assert_pool_full(&c).await;
    c.stop().await;
    out
}

struct Pd {
    p: Instance,
    ds: Vec<Instance>,
    proxy: StartedProxy,
    url: String,
}

impl Pd {
    #[allow(clippy::too_many_arguments)]
    async fn start(
        spec: &str,
        backend: BackendKind,
        tp: (usize, usize),
        decodes: usize,
        mode: TransferMode,
        prefix_cache: bool,
        decode_blocks: Option<usize>,
    ) -> Self {
        let tag = next_tag();
        let p = instance(&format!("p-pc{tag}"), spec, tp.0, Some(backend), |o| {
            o.max_num_batched_tokens = 24;
            o.prefix_cache = prefix_cache;
        })
        .await;
        let mut ds = Vec::new();
        for i in 0..decodes {
            ds.push(
                instance(&format!("d-pc{tag}-{i}"), spec, tp.1, Some(backend), |o| {
                    o.transfer_mode = mode;
                    o.prefix_cache = prefix_cache;
                    if let Some(n) = decode_blocks {
                        o.num_blocks = Some(n);
                        o.watermark = 0.0;
                    }
                })
                .await,
            );
        }
        let mut args = ProxyArgs::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![p.url()],
            ds.iter().map(Instance::url).collect(),
        );
        args.timeout = Duration::from_secs(60);
        let proxy = start_proxy(&format!("proxy-pc{tag}"), args).await.unwrap();
        let url = format!("http://{}", proxy.addr);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = pdserve_actors::http::http_client()
                .build()
                .unwrap()
                .get(format!("{url}/health"))
                .send()
                .await
            {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "proxy never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { p, ds, proxy, url }
    }

    /// KV bytes that moved into decode instances (push: written by prefill; pull: read by
    /// decode).
    fn bytes_moved(&self) -> u64 {
        self.p.kv_figures().unwrap().bytes_sent
            + self
                .ds
                .iter()
                .map(|d| d.kv_figures().unwrap().bytes_received)
                .sum::<u64>()
    }

    async fn stop(self) {
        assert_pool_full(&self.p).await;
        for d in &self.ds {
            assert_pool_full(d).await;
        }
        self.proxy.stop().await;
        self.p.stop().await;
        for d in self.ds {
            d.stop().await;
        }
    }
}

/// The workload through a proxy in front of 1 prefill and `decodes` decode instances, with
/// the prefix cache on; checks it against `reference` and that decode reused its cache.
async fn check_pd(
    spec: &str,
    backend: BackendKind,
    tp: (usize, usize),
    decodes: usize,
    mode: TransferMode,
    reference: &[Vec<u64>],
) {
    let pd = Pd::start(spec, backend, tp, decodes, mode, true, None).await;
    let got = run_workload(&pd.url).await;
    let what = format!("{spec} {backend:?} tp {tp:?} x{decodes} {}", mode.as_str());
    assert_eq!(got, reference, "{what}");
    let mut cached = 0;
    for d in &pd.ds {
        let s = d.stats().await.unwrap();
        cached += s.prompt_tokens_cached;
        assert_eq!(d.kv_figures().unwrap().failures, 0, "{what}");
    }
    assert!(
        cached > 0,
        "{what}: decode served no prompt token from its cache"
    );
    let ps = pd.p.stats().await.unwrap();
    assert!(
        ps.prompt_tokens_cached > 0,
        "{what}: prefill computed every prompt in full: {ps:?}"
    );
    pd.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_output_equals_no_cache_colocated_and_disaggregated() {
    let reference = colocated(SMALL, false).await;
    assert_eq!(colocated(SMALL, true).await, reference, "colocated");
    for mode in [TransferMode::Pull, TransferMode::Push] {
        check_pd(SMALL, BackendKind::Tcp, (1, 1), 1, mode, &reference).await;
    }
    // Two decode instances: one often lacks blocks the prefill instance has cached (the
    // prefill side must still move them).
    for mode in [TransferMode::Pull, TransferMode::Push] {
        check_pd(SMALL, BackendKind::Shm, (1, 1), 2, mode, &reference).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_output_equals_no_cache_across_heterogeneous_tp() {
    let reference = colocated(TP3, false).await;
    for mode in [TransferMode::Pull, TransferMode::Push] {
        check_pd(TP3, BackendKind::Tcp, (1, 3), 1, mode, &reference).await;
    }
}

/// On a 2-turn chat, turn 2 moves only the blocks turn 1 did not: bytes counted, in both
/// modes; without the cache it moves its whole prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_moves_only_the_new_blocks() {
    let model = load_model(&ModelSource::Synthetic(SMALL.into())).unwrap();
    let c = &model.config;
    let bytes_per_block = (2 * c.num_layers * c.num_kv_heads * BLOCK * c.head_dim * 4) as u64;
    let turn1 = tokens(8 * BLOCK, 11);
    let turn2 = cat(&[&turn1, &tokens(2 * BLOCK + 3, 12)]);
    for mode in [TransferMode::Pull, TransferMode::Push] {
        for prefix_cache in [true, false] {
            let pd = Pd::start(SMALL, BackendKind::Tcp, (1, 1), 1, mode, prefix_cache, None).await;
            let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
            let (status, v1) = post(&pd.url, &request(&turn1, 4)).await;
            assert_eq!(status, 200, "{v1}");
            assert_eq!(cached(&v1), 0, "turn 1 has nothing cached: {v1}");
            let after1 = pd.bytes_moved();
            assert_eq!(after1, 8 * bytes_per_block, "turn 1 moves its 8 blocks");
            let (status, v2) = post(&pd.url, &request(&turn2, 4)).await;
            assert_eq!(status, 200, "{v2}");
            let turn2_bytes = pd.bytes_moved() - after1;
            let what = format!("{} cache={prefix_cache}", mode.as_str());
            if prefix_cache {
                // 8 blocks cached on decode; 2 full + 1 partial new ones move.
                assert_eq!(turn2_bytes, 3 * bytes_per_block, "{what}");
                let s = pd.ds[0].stats().await.unwrap();
                assert_eq!(s.prompt_tokens_cached, (8 * BLOCK) as u64, "{what}: {s:?}");
                // The client is told, as OpenAI's usage says it.
                assert_eq!(cached(&v2), 8 * BLOCK, "{what}: {v2}");
            } else {
                assert_eq!(turn2_bytes, 11 * bytes_per_block, "{what}");
                assert_eq!(cached(&v2), 0, "{what}: {v2}");
            }
            pd.stop().await;
        }
    }
}

/// A decode pool too small to keep every prefix: cached blocks are evicted while other
/// hand-offs read into (pull) or are written into (push) blocks next to them. Answers stay
/// exact, evictions happened, and every pool returns to full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_pressure_during_transfers_keeps_answers_exact() {
    // 12 prompts in waves of 4, sharing 3 prefixes, ~9 blocks each with their output.
    let prompts: Vec<Vec<u32>> = (0..12)
        .map(|i| cat(&[&tokens(4 * BLOCK + 3, 20 + i % 3), &tokens(20 + i, 30 + i)]))
        .collect();
    let reference = {
        let c = instance(&format!("c-evict-{}", next_tag()), SMALL, 1, None, |o| {
            o.prefix_cache = false;
        })
        .await;
        let mut out = Vec::new();
        for p in &prompts {
            let (status, v) = post(&c.url(), &request(p, MAX_TOKENS)).await;
            assert_eq!(status, 200, "{v}");
            out.push(common::token_ids(&v));
        }
        c.stop().await;
        out
    };
    for mode in [TransferMode::Pull, TransferMode::Push] {
        let pd = Pd::start(SMALL, BackendKind::Tcp, (1, 1), 1, mode, true, Some(48)).await;
        for (w, wave) in prompts.chunks(4).enumerate() {
            let handles: Vec<_> = wave
                .iter()
                .cloned()
                .map(|p| {
                    let url = pd.url.clone();
                    tokio::spawn(async move { post(&url, &request(&p, MAX_TOKENS)).await })
                })
                .collect();
            for (i, h) in handles.into_iter().enumerate() {
                let (status, v) = h.await.unwrap();
                assert_eq!(status, 200, "{} {v}", mode.as_str());
                assert_eq!(
                    common::token_ids(&v),
                    reference[w * 4 + i],
                    "{} prompt {}",
                    mode.as_str(),
                    w * 4 + i
                );
            }
        }
        let s = pd.ds[0].stats().await.unwrap();
        assert!(
            s.cache_evictions > 0,
            "{}: no eviction pressure: {s:?}",
            mode.as_str()
        );
        assert!(s.prompt_tokens_cached > 0, "{}: {s:?}", mode.as_str());
        pd.stop().await;
    }
}
