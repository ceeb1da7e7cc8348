//! KV cache tiers below the block pool (issue 30): a host spill region, a disk directory and a
//! directory several instances share.
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

use pdserve_actors::kv_tiers::{TierFigures, TierSettings, WritePolicy};
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
    TierSettings::host_only(64 << 20)
}

fn disk_only(dir: &Path) -> TierSettings {
    TierSettings::disk_only(dir, 256 << 20)
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
    // Streamed layer by layer (the default) at tp 1 and 2, and loaded whole.
    for (tp, stream) in [(1, true), (2, true), (1, false)] {
        let want = reference(&REVISIT, tp).await;
        let mut settings = host_only();
        settings.stream_layers = stream;
        let name = format!("host-tp{tp}-{}", if stream { "stream" } else { "whole" });
        let inst = instance(&name, tp, Some(settings)).await;
        let (run, inst) = conversation_run(inst, &REVISIT, |i, _| async { i }).await;
        assert_eq!(run.first, want.first, "{name}: first turns");
        assert_eq!(run.second, want.second, "{name}: second turns");
        for &cached in &run.second_cached {
            assert!(
                cached >= TURN1 as u64,
                "{name}: the evicted first turn is restored, not computed: {:?}",
                run.second_cached
            );
        }
        let f = inst.kv_tiers().unwrap().figures();
        let host = f.host.unwrap();
        assert!(
            host.hits >= (REVISIT.len() * TURN1 / BLOCK) as u64,
            "{name}: {f:?}"
        );
        assert_eq!(host.misses, 0, "{f:?}");
        assert!(host.bytes_read > 0 && host.bytes_written > 0, "{f:?}");
        assert!(f.disk.is_none());
        if stream {
            assert!(f.streamed >= REVISIT.len() as u64, "{name}: {f:?}");
        } else {
            assert_eq!(f.streamed, 0, "{name}: {f:?}");
        }
        inst.stop().await;
    }
}

/// Layer-by-layer load-back: a restore from disk admits its request once the files are
/// opened, and the step computing the rest of the prompt takes each layer as it lands. The
/// `tier_stream_hold` fault lands a restore's last layer only once a rank has taken an
/// earlier one, so a restore whose compute waited for the whole load would time out and be
/// recomputed (cached 0, `streamed` 0): every second turn here is restored instead, with
/// the ranks (tp 2, each reading its heads of the files) computing before the last layer
/// arrived, and every answer token-identical to an instance without tiers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_restore_computes_before_its_last_layer_lands() {
    use pdserve_runtime::faults::{Fault, FaultInjector, FaultSection};
    let want = reference(&REVISIT, 2).await;
    let dir = tempfile::tempdir().unwrap();
    let faults = FaultInjector::new(&FaultSection {
        tier_stream_hold: 1.0,
        ..FaultSection::default()
    })
    .unwrap();
    let mut o = InstanceOptions::local(
        "stream-hold",
        load_model(&ModelSource::Synthetic("small".into())).unwrap(),
    );
    o.tp = 2;
    o.block_size = BLOCK;
    o.num_blocks = Some(POOL);
    o.watermark = 0.0;
    o.kv_tiers = Some(disk_only(dir.path()));
    o.faults = Some(faults.clone());
    let inst = Instance::start(o).await.unwrap();
    let (run, inst) = conversation_run(inst, &REVISIT, |inst, _| async move {
        flush(&inst);
        inst
    })
    .await;
    assert_eq!(run.first, want.first, "first turns");
    assert_eq!(run.second, want.second, "second turns");
    for &cached in &run.second_cached {
        assert!(cached >= TURN1 as u64, "restored: {:?}", run.second_cached);
    }
    let f = inst.kv_tiers().unwrap().figures();
    assert!(f.streamed >= REVISIT.len() as u64, "{f:?}");
    assert!(
        f.early_layers >= f.streamed,
        "every streamed restore was computed on before its last layer landed: {f:?}"
    );
    assert!(faults.injected(Fault::TierStreamHold) >= REVISIT.len() as u64);
    let disk = f.disk.unwrap();
    assert_eq!(disk.misses, 0, "{f:?}");
    assert!(disk.hits >= (REVISIT.len() * TURN1 / BLOCK) as u64, "{f:?}");
    assert_eq!(f.load_timeouts, 0, "{f:?}");
    inst.stop().await;
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
    // The tiers' time on the ranks' step path and the load-back latency, as histograms.
    for name in [
        "pdserve_kv_tier_spill_seconds",
        "pdserve_kv_tier_load_seconds",
    ] {
        let count = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_count ")))
            .and_then(|v| v.trim().parse::<u64>().ok());
        assert!(count.is_some_and(|c| c > 0), "{name}_count: {count:?}");
    }
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_finds_the_disk_tier_warm() {
    let dir = tempfile::tempdir().unwrap();
    restart_finds_the_disk_tier_warm(disk_only(dir.path()), "restart").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_writes_the_host_region_to_disk_so_a_restart_finds_it() {
    let dir = tempfile::tempdir().unwrap();
    // A host region large enough that nothing overflows to disk while serving: only the
    // stop puts the blocks there.
    let mut settings = disk_only(dir.path());
    settings.host_capacity_bytes = 64 << 20;
    restart_finds_the_disk_tier_warm(settings, "persist").await;
}

async fn restart_finds_the_disk_tier_warm(settings: TierSettings, name: &str) {
    let want = reference(&REVISIT, 1).await;
    let with_host = settings.host_capacity_bytes > 0;
    let inst = instance(&format!("{name}-a"), 1, Some(settings.clone())).await;
    let name = name.to_string();
    let (run, inst) = conversation_run(inst, &REVISIT, |inst, _| async move {
        flush(&inst);
        if with_host {
            let f = inst.kv_tiers().unwrap().figures();
            assert_eq!(f.disk.unwrap().blocks, 0, "nothing overflowed: {f:?}");
        }
        let report = inst.stop().await;
        assert!(report.clean(), "{report:?}");
        assert_eq!(report.tier_blocks_persisted > 0, with_host, "{report:?}");
        // A new instance, a new pool: only the disk tier remembers.
        instance(&format!("{name}-b"), 1, Some(settings)).await
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

fn shared_only(dir: &Path) -> TierSettings {
    TierSettings {
        host_capacity_bytes: 0,
        disk_dir: None,
        disk_capacity_bytes: 0,
        shared_dir: Some(dir.to_path_buf()),
        shared_url: None,
        shared_capacity_bytes: 256 << 20,
        write_policy: WritePolicy::WriteBack,
        load_timeout: Duration::from_secs(30),
        stream_layers: true,
    }
}

/// The first turns on instance `a`, the second turns on instance `b` running beside it, both
/// on the shared store of `settings`; `between` runs once a's writes are done (damage). `b`
/// opened the store before `a` wrote anything: it finds a's blocks by listing the store, not from its
/// start-up scan. Checks the answers against a run without tiers and that the exported
/// metrics carry shared-store hits; returns the run and both instances' shared figures.
async fn across_a_shared_store<F>(
    name: &str,
    settings: TierSettings,
    between: F,
) -> (Run, TierFigures, TierFigures)
where
    F: FnOnce(&Instance, &[Vec<u32>]) + Send + 'static,
{
    let want = reference(&REVISIT, 1).await;
    let a = instance(&format!("{name}-a"), 1, Some(settings.clone())).await;
    let b = instance(&format!("{name}-b"), 1, Some(settings)).await;
    assert_eq!(b.kv_tiers().unwrap().figures().shared.unwrap().blocks, 0);
    let held = std::sync::Arc::new(std::sync::Mutex::new(None));
    let keep = held.clone();
    let (run, b) = conversation_run(a, &REVISIT, |a, first| async move {
        let store = a.kv_tiers().unwrap().shared().unwrap();
        assert!(
            store.flush(Duration::from_secs(10)),
            "shared writes did not end"
        );
        between(&a, &first);
        // b learns of a's blocks (a directory listing or a Redis key scan; a flush runs one now).
        let seen = b.kv_tiers().unwrap().shared().unwrap();
        assert!(
            seen.flush(Duration::from_secs(10)),
            "b's store thread did not answer"
        );
        *keep.lock().unwrap() = Some(a);
        b
    })
    .await;
    let a = held.lock().unwrap().take().unwrap();
    assert_eq!(run.first, want.first, "first turns (on a)");
    assert_eq!(
        run.second, want.second,
        "second turns (on b) equal a run without tiers"
    );
    let fa = a.kv_tiers().unwrap().figures().shared.unwrap();
    let fb = b.kv_tiers().unwrap().figures().shared.unwrap();
    assert!(fa.bytes_written > 0 && fa.hits == 0, "{fa:?}");
    let metrics = common::get_text(&b.url(), "/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("pdserve_kv_tier_hits_total{") && l.contains("tier=\"shared\"")),
        "shared-store hits exported"
    );
    a.stop().await;
    b.stop().await;
    (run, fa, fb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_one_instance_computed_is_restored_by_another_from_a_shared_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (run, _, fb) =
        across_a_shared_store("shared-dir", shared_only(dir.path()), |_, _| {}).await;
    for &cached in &run.second_cached {
        assert!(
            cached >= TURN1 as u64,
            "b restores a's evicted first turns: {:?}",
            run.second_cached
        );
    }
    assert!(
        fb.hits >= (REVISIT.len() * TURN1 / BLOCK) as u64 && fb.misses == 0,
        "{fb:?}"
    );
}

/// A `redis-server` (Debian's package) for one test: a free port on 127.0.0.1, no
/// persistence, killed on drop. `None` when the binary is missing outside CI (`.ci/run`
/// installs it; under `CI=true` a missing server fails the test).
struct RedisServer {
    child: Option<std::process::Child>,
    port: u16,
}

impl RedisServer {
    fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port)
    }

    fn start_on(port: u16) -> Option<Self> {
        let spawned = std::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(c) => c,
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!("skipping: redis-server not runnable here ({e}); .ci/run installs it");
                return None;
            }
            Err(e) => panic!("redis-server (Debian package redis-server) is needed: {e}"),
        };
        let server = Self {
            child: Some(child),
            port,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while server.client().get_connection().is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn on_redis(url: &str) -> TierSettings {
    TierSettings {
        host_capacity_bytes: 0,
        disk_dir: None,
        disk_capacity_bytes: 0,
        shared_dir: None,
        shared_url: Some(url.into()),
        shared_capacity_bytes: 256 << 20,
        write_policy: WritePolicy::WriteBack,
        load_timeout: Duration::from_secs(30),
        stream_layers: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_one_instance_computed_is_restored_by_another_from_redis_and_damage_is_a_miss() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let client = redis.client();
    // Conversation 0's first block is damaged in the store (one flipped byte): b recomputes
    // it (and all after it), the others are restored.
    let (run, _, fb) = across_a_shared_store("redis", on_redis(&redis.url()), move |a, first| {
        rewrite_first_block(&client, a, first, |value| {
            let at = value.len() / 2;
            value[at] ^= 0x40;
        })
    })
    .await;
    first_block_recomputed_the_rest_restored(&run, &fb);
}

/// Rewrites, in `a`'s Redis store, the value of conversation 0's first block with `change`.
fn rewrite_first_block(
    client: &redis::Client,
    a: &Instance,
    first: &[Vec<u32>],
    change: impl FnOnce(&mut Vec<u8>),
) {
    let tiers = a.kv_tiers().unwrap();
    let store = tiers.shared().unwrap().as_redis().unwrap();
    let mut tokens = first_turn(0);
    tokens.extend_from_slice(&first[0]);
    let key = store.key_of(tiers.block_hashes(&tokens)[0]);
    let mut con = client.get_connection().unwrap();
    let mut value: Vec<u8> = redis::cmd("GET").arg(&key).query(&mut con).unwrap();
    assert!(!value.is_empty(), "a wrote the block");
    change(&mut value);
    redis::cmd("SET")
        .arg(&key)
        .arg(value)
        .query::<()>(&mut con)
        .unwrap();
}

/// b recomputed conversation 0 from its first block (one counted miss) and restored every
/// other conversation's first turn from the store.
fn first_block_recomputed_the_rest_restored(run: &Run, fb: &TierFigures) {
    assert_eq!(
        run.second_cached[0], 0,
        "the bad first block is recomputed: {:?}",
        run.second_cached
    );
    for &cached in &run.second_cached[1..] {
        assert!(cached >= TURN1 as u64, "{:?}", run.second_cached);
    }
    assert_eq!(fb.misses, 1, "{fb:?}");
    assert!(
        fb.hits >= ((REVISIT.len() - 1) * TURN1 / BLOCK) as u64,
        "{fb:?}"
    );
}

/// Hostile input in the store: under a valid key, a value longer than one block record (a
/// whole record with a megabyte after it). It is refused before decoding — at most one byte
/// past a record is fetched — and counted as a miss; b recomputes that conversation, restores
/// the others, and answers exactly as a run without tiers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_value_longer_than_a_block_record_is_a_miss_and_answers_stay_exact() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let client = redis.client();
    let (run, _, fb) =
        across_a_shared_store("redis-long", on_redis(&redis.url()), move |a, first| {
            rewrite_first_block(&client, a, first, |value| {
                value.extend_from_slice(&vec![0x5a; 1 << 20])
            })
        })
        .await;
    first_block_recomputed_the_rest_restored(&run, &fb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_going_down_never_stalls_serving_and_the_store_comes_back() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let port = redis.port;
    let want = reference(&REVISIT, 1).await;
    let inst = instance("redis-outage", 1, Some(on_redis(&redis.url()))).await;
    let (run, inst) = conversation_run(inst, &REVISIT, |inst, _| async move {
        let store = inst.kv_tiers().unwrap().shared().unwrap();
        assert!(store.flush(Duration::from_secs(10)));
        assert!(store.figures().blocks > 0, "{:?}", store.figures());
        redis.kill(); // the store dies with blocks this instance counts on
        inst
    })
    .await;
    // Every answer is still right: a restore the dead store cannot serve is computed.
    assert_eq!(run.first, want.first);
    assert_eq!(run.second, want.second, "second turns with the store down");
    let f = inst.kv_tiers().unwrap().figures().shared.unwrap();
    assert_eq!(f.hits, 0, "{f:?}");
    let tiers = inst.kv_tiers().unwrap().clone();
    let store = tiers.shared().unwrap().as_redis().unwrap();
    assert_eq!(
        store.outages(),
        1,
        "the failed restore found the store down"
    );
    // The store comes back (empty: no persistence); once its pause is over the instance
    // relearns what the store holds (nothing), writes and restores again.
    let _back = RedisServer::start_on(port).expect("redis-server restarts");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.is_down() {
        assert!(std::time::Instant::now() < deadline, "the store stays down");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store.flush(Duration::from_secs(10)));
    assert_eq!(
        store.figures().blocks,
        0,
        "the index follows the empty store"
    );
    let (again, inst) = conversation_run(inst, &[0], |inst, _| async move {
        let store = inst.kv_tiers().unwrap().shared().unwrap();
        assert!(store.flush(Duration::from_secs(10)));
        inst
    })
    .await;
    assert_eq!(again.first, want.first);
    assert_eq!(again.second[0], want.second[0]);
    assert!(
        again.second_cached[0] >= TURN1 as u64,
        "{:?}",
        again.second_cached
    );
    let f = inst.kv_tiers().unwrap().figures().shared.unwrap();
    assert!(f.hits >= (TURN1 / BLOCK) as u64, "{f:?}");
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
