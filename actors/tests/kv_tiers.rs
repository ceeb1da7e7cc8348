//! KV cache tiers below the block pool (issue 30): a host spill region and a disk directory.
//!
//! A pool too small for the conversations evicts their blocks; the second turn of an evicted
//! conversation restores its prefix from a tier instead of computing it. Under greedy
//! sampling every answer must be token-identical to an instance without tiers, the restored
//! tokens are reported as cached (`usage.prompt_tokens_details.cached_tokens`), and the pool
//! is full again afterwards. Damaged disk blocks (a flipped byte, a truncated file, a deleted
//! file) are misses — counted, recomputed, never wrong KV — and a new instance on the same
//! directory finds the disk tier warm.

mod common;
use common::{assert_pool_full, post};

use pdserve_actors::kv_tiers::{TierSettings, WritePolicy};
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

const BLOCK: usize = 8;
/// A pool far smaller than the conversations' KV (each needs 6–8 blocks).
const POOL: usize = 16;
/// Prompt tokens of a first turn: 5 whole blocks.
const TURN1: usize = 5 * BLOCK;
const MAX_TOKENS: usize = 8;
const CONVERSATIONS: usize = 6;

async fn instance(name: &str, tp: usize, tiers: Option<TierSettings>) -> Instance {
    let mut o = InstanceOptions::local(
        name,
        load_model(&ModelSource::Synthetic("small".into())).unwrap(),
    );
    o.tp = tp;
    o.block_size = BLOCK;
    o.num_blocks = Some(POOL);
    o.watermark = 0.0;
    o.kv_tiers = tiers;
    Instance::start(o).await.unwrap()
}

fn host_only() -> TierSettings {
    TierSettings {
        host_capacity_bytes: 64 << 20,
        disk_dir: None,
        disk_capacity_bytes: 0,
        write_policy: WritePolicy::WriteBack,
        load_timeout: Duration::from_secs(30),
    }
}

fn disk_only(dir: &Path) -> TierSettings {
    TierSettings {
        host_capacity_bytes: 0,
        disk_dir: Some(dir.to_path_buf()),
        disk_capacity_bytes: 256 << 20,
        write_policy: WritePolicy::WriteBack,
        load_timeout: Duration::from_secs(30),
    }
}

fn first_turn(c: usize) -> Vec<u32> {
    (0..TURN1)
        .map(|t| ((t * 31 + c * 57 + 3) % 250) as u32)
        .collect()
}

fn request(prompt: &[u32]) -> Value {
    json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": true, "return_token_ids": true})
}

/// One answer: its token ids and its cached prompt tokens.
async fn ask(inst: &Instance, prompt: &[u32]) -> (Vec<u32>, u64) {
    let (status, v) = post(&inst.url(), &request(prompt)).await;
    assert_eq!(status, 200, "{v}");
    let ids = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (ids, cached)
}

/// The second turn of conversation `c`: its first prompt, the answer, a new message.
fn second_turn(c: usize, answer: &[u32]) -> Vec<u32> {
    let mut p = first_turn(c);
    p.extend_from_slice(answer);
    p.extend((0..10).map(|t| ((t * 7 + c * 13 + 200) % 250) as u32));
    p
}

struct Run {
    first: Vec<Vec<u32>>,
    second: Vec<Vec<u32>>,
    second_cached: Vec<u64>,
}

/// First turns of every conversation (which evicts the earlier ones from the pool), then
/// `between` (damage, a restart...), then the second turns of `revisit` against the instance
/// `between` returns.
async fn conversation_run<F, Fut>(inst: Instance, revisit: &[usize], between: F) -> (Run, Instance)
where
    F: FnOnce(Instance, Vec<Vec<u32>>) -> Fut,
    Fut: std::future::Future<Output = Instance>,
{
    let mut first = Vec::new();
    for c in 0..CONVERSATIONS {
        first.push(ask(&inst, &first_turn(c)).await.0);
    }
    assert_pool_full(&inst).await;
    let inst = between(inst, first.clone()).await;
    let (mut second, mut second_cached) = (Vec::new(), Vec::new());
    for &c in revisit {
        let (ids, cached) = ask(&inst, &second_turn(c, &first[c])).await;
        second.push(ids);
        second_cached.push(cached);
    }
    assert_pool_full(&inst).await;
    (
        Run {
            first,
            second,
            second_cached,
        },
        inst,
    )
}

/// The reference: the same conversations on an instance without tiers.
async fn reference(revisit: &[usize], tp: usize) -> Run {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let inst = instance(&format!("ref-{n}-tp{tp}"), tp, None).await;
    let (run, inst) = conversation_run(inst, revisit, |i, _| async { i }).await;
    assert!(
        run.second_cached.iter().all(|&c| c == 0),
        "without tiers the evicted prefixes are recomputed: {:?}",
        run.second_cached
    );
    inst.stop().await;
    run
}

/// Waits until the disk tier wrote everything queued.
fn flush(inst: &Instance) {
    let disk = inst.kv_tiers().unwrap().disk().unwrap();
    assert!(
        disk.flush(Duration::from_secs(10)),
        "disk writes did not end"
    );
}

const REVISIT: [usize; 3] = [0, 1, 2];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_turns_restore_from_the_host_tier_token_identical() {
    for tp in [1, 2] {
        let want = reference(&REVISIT, tp).await;
        let inst = instance(&format!("host-tp{tp}"), tp, Some(host_only())).await;
        let (run, inst) = conversation_run(inst, &REVISIT, |i, _| async { i }).await;
        assert_eq!(run.first, want.first, "tp={tp}: first turns");
        assert_eq!(run.second, want.second, "tp={tp}: second turns");
        for &cached in &run.second_cached {
            assert!(
                cached >= TURN1 as u64,
                "tp={tp}: the evicted first turn is restored, not computed: {:?}",
                run.second_cached
            );
        }
        let f = inst.kv_tiers().unwrap().figures();
        let host = f.host.unwrap();
        assert!(
            host.hits >= (REVISIT.len() * TURN1 / BLOCK) as u64,
            "tp={tp}: {f:?}"
        );
        assert_eq!(host.misses, 0, "{f:?}");
        assert!(host.bytes_read > 0 && host.bytes_written > 0, "{f:?}");
        assert!(f.disk.is_none());
        inst.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_turns_restore_from_the_disk_tier_and_damage_is_a_counted_miss() {
    let want = reference(&[0, 1, 2, 3], 1).await;
    let dir = tempfile::tempdir().unwrap();
    let inst = instance("disk", 1, Some(disk_only(dir.path()))).await;
    // Conversation 0: a flipped byte in its first block; 1: truncated; 2: deleted; 3 intact
    // (on disk or still in the pool).
    let damaged: std::sync::Arc<std::sync::Mutex<Vec<u64>>> = Default::default();
    let seen = damaged.clone();
    let (run, inst) = conversation_run(inst, &[0, 1, 2, 3], |inst, first| async move {
        flush(&inst);
        let tiers = inst.kv_tiers().unwrap().clone();
        let disk = tiers.disk().unwrap();
        for (c, answer) in first.iter().enumerate().take(3) {
            let mut tokens = first_turn(c);
            tokens.extend_from_slice(answer);
            let h = tiers.block_hashes(&tokens);
            assert!(
                disk.contains(h[0]) && disk.contains(h[4]),
                "conversation {c}'s evicted blocks are on disk"
            );
            let f = disk.file_of(h[0]);
            let bytes = std::fs::read(&f).unwrap();
            match c {
                0 => {
                    let mut b = bytes.clone();
                    let at = b.len() / 2;
                    b[at] ^= 0x40;
                    std::fs::write(&f, b).unwrap();
                }
                1 => std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap(),
                2 => std::fs::remove_file(&f).unwrap(),
                _ => {}
            }
            seen.lock().unwrap().push(h[0]);
        }
        inst
    })
    .await;
    assert_eq!(damaged.lock().unwrap().len(), 3);
    assert_eq!(run.first, want.first, "first turns");
    assert_eq!(
        run.second, want.second,
        "second turns: damage never changes the answer"
    );
    assert_eq!(
        &run.second_cached[..3],
        &[0, 0, 0],
        "a damaged first block is recomputed, and so is everything after it"
    );
    assert!(
        run.second_cached[3] >= TURN1 as u64,
        "{:?}",
        run.second_cached
    );
    let f = inst.kv_tiers().unwrap().figures();
    let disk = f.disk.unwrap();
    assert_eq!(disk.misses, 3, "checksum, short read, missing: {f:?}");
    assert!(disk.hits >= (TURN1 / BLOCK) as u64, "{f:?}");
    assert_eq!(disk.discarded, 3, "bad files are forgotten: {f:?}");
    // The bad copies were removed; a block recomputed and evicted again is stored anew,
    // and reads back whole.
    flush(&inst);
    let disk_tier = inst.kv_tiers().unwrap().disk().unwrap();
    for &h in damaged.lock().unwrap().iter() {
        assert!(
            !disk_tier.contains(h) || disk_tier.read(h).is_ok(),
            "block {h:016x} is either gone or good again"
        );
    }
    let metrics = common::get_text(&inst.url(), "/metrics").await;
    for reason in ["checksum", "short_read", "missing"] {
        let label = format!("reason=\"{reason}\"");
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("pdserve_kv_tier_misses_total{")
                    && l.contains("tier=\"disk\"")
                    && l.contains(&label)),
            "no disk miss with {label} in /metrics"
        );
    }
    assert!(
        metrics.contains("pdserve_kv_tier_hits_total{"),
        "hits exported"
    );
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_finds_the_disk_tier_warm() {
    let want = reference(&REVISIT, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let settings = disk_only(dir.path());
    let inst = instance("restart-a", 1, Some(settings.clone())).await;
    let (run, inst) = conversation_run(inst, &REVISIT, |inst, _| async move {
        flush(&inst);
        let report = inst.stop().await;
        assert!(report.clean(), "{report:?}");
        // A new instance, a new pool: only the disk tier remembers.
        instance("restart-b", 1, Some(settings)).await
    })
    .await;
    assert_eq!(run.first, want.first);
    assert_eq!(run.second, want.second, "second turns after the restart");
    for &cached in &run.second_cached {
        assert!(cached >= TURN1 as u64, "{:?}", run.second_cached);
    }
    let f = inst.kv_tiers().unwrap().figures();
    let disk = f.disk.unwrap();
    assert!(disk.hits >= (REVISIT.len() * TURN1 / BLOCK) as u64, "{f:?}");
    assert_eq!(disk.misses, 0, "{f:?}");
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_selective_policy_writes_only_reused_blocks() {
    let mut s = host_only();
    s.write_policy = WritePolicy::Selective { min_hits: 1 };
    let inst = instance("selective", 1, Some(s)).await;
    // Conversations never reused: nothing is written.
    for c in 0..CONVERSATIONS {
        ask(&inst, &first_turn(c)).await;
    }
    let f = inst.kv_tiers().unwrap().figures();
    assert_eq!(f.host.unwrap().blocks, 0, "{f:?}");
    assert!(f.not_spilled > 0, "{f:?}");
    // A prompt asked twice in a row is a hit the second time, then evicted: written.
    ask(&inst, &first_turn(100)).await;
    ask(&inst, &first_turn(100)).await;
    for c in 0..CONVERSATIONS {
        ask(&inst, &first_turn(200 + c)).await;
    }
    let f = inst.kv_tiers().unwrap().figures();
    assert!(
        f.host.unwrap().blocks >= (TURN1 / BLOCK) as u64 - 1,
        "{f:?}"
    );
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_past_its_timeout_is_computed_without_the_tiers() {
    let want = reference(&REVISIT, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let mut settings = disk_only(dir.path());
    settings.load_timeout = Duration::ZERO;
    let inst = instance("timeout", 1, Some(settings)).await;
    let (run, inst) = conversation_run(inst, &REVISIT, |inst, _| async move {
        flush(&inst);
        inst
    })
    .await;
    assert_eq!(run.first, want.first);
    assert_eq!(
        run.second, want.second,
        "a timed-out load changes no answer"
    );
    let f = inst.kv_tiers().unwrap().figures();
    // Each load either beat its (zero) timeout and was restored, or was abandoned.
    assert!(f.load_timeouts + f.disk.unwrap().hits > 0, "{f:?}");
    inst.stop().await;
}
