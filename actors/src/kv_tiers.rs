//! KV cache tiers below an instance's block pool (issue 30): a **host** spill region and a
//! **local disk** directory, both LRU by capacity.
//!
//! When the prefix cache evicts a full, registered block, the Scheduler has every TP rank copy
//! the block's KV (all layers, K and V, its heads) out of its cache on the rank thread, ahead
//! of the step that reuses the block ([`spill_jobs`]); the copies are joined rank by rank into
//! one [`TierBlock`] and offered to the tiers ([`KvTiers::offer`]). On a prefix lookup that
//! the pool misses (a local request's, or a decode instance's P/D request's before its KV is
//! fetched, which then fetches only the rest), the Scheduler asks the tiers for the following
//! blocks ([`KvTiers::contains_run`]), loads them off the actors' path ([`KvTiers::load_run`], in
//! `spawn_blocking`: disk reads), writes them into freshly allocated pool blocks on the rank
//! threads ([`restore_jobs`]) and registers them in the prefix cache; the request is then
//! admitted and computes only the rest.
//!
//! **Write policy** ([`WritePolicy`]): `write_back` offers every evicted block; `selective`
//! only blocks that were reused at least `min_hits` times (Dynamo KVBM's frequency filter).
//! A block the host tier evicts moves on to the disk tier; with no host capacity, blocks go
//! straight to disk. Both tiers keep a block after a hit (inclusive), so a block that leaves
//! the pool again costs no second write.
//!
//! **Verified restores.** Every stored block carries an XXH3-64 checksum of its bytes and its
//! full key: the chained block hash, its parent's hash, its token ids and the compatibility
//! key ([`TierShape::compat`]: pdserve version, model shape and weight fingerprint, KV dtype,
//! block size, TP size). A restore checks all of them; a checksum mismatch, a short read, a
//! missing file, another compatibility key or another key is a **miss**: the block is
//! recomputed, the miss is counted (`pdserve_kv_tier_misses_total{tier,reason}`) and logged
//! at `warn`, and the bad file is removed. Never wrong KV.
//!
//! The disk tier's files live in `<dir>/<compat hash>/`; at start its index is rebuilt from
//! what is there after verifying each file, so a restarted instance finds it warm. Writes go
//! through one named thread (`pdserve-kv-disk`) fed by a bounded queue (a full queue drops
//! the write, counted); reads run in the caller's blocking task.
//!
//! **The shared store** is a directory several instances read and write (`kv_tiers.shared_dir`,
//! in the disk tier's format: [`disk::DirMode::Shared`]) or a Redis/Valkey server
//! (`kv_tiers.shared_url`, [`redis_store`]: the same records as values). Every block offered to the
//! tiers is also written there at once (write-through), so another instance finds a prefix
//! as soon as one instance has evicted it; lookups go host, disk, then the shared store. The
//! compatibility key names its subdirectory, so instances of other models or layouts never
//! exchange blocks, and every restore verifies the block as from the disk tier.
//!
//! **KV events.** Each tier logs the hashes it gains and drops (the host region's inserts and
//! LRU victims, the disk tier's and the shared store's index), drained with the pool's events
//! for the proxy ([`KvTiers::kv_events`], medium `host`, `disk`, `shared`): the KV router
//! credits a prefix found in a tier at `proxy.kv_tier_credit` (see `pdserve_core::kv_events`).

mod disk;
mod host;
mod queue;
pub mod redis_store;
pub mod stream;

use crate::block_manager::{BlockHash, Evicted};
use crate::kv_events::{Medium, TierEvents};
use pdserve_gpu::kv::KvCache;
use pdserve_gpu::tp::KvJob;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub use disk::{DirMode, DiskTier};
pub use redis_store::RedisTier;
use stream::Source;
pub use stream::{RestoreStream, StreamFailure, StreamLoad};

/// Why a block could not be restored from a tier (each is a miss, never wrong KV).
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The tier does not hold the block (a missing file included).
    #[error("block not stored")]
    Missing,
    /// The stored bytes do not match their checksum.
    #[error("checksum mismatch")]
    Checksum,
    /// The stored block is shorter than its header says.
    #[error("short read: {0}")]
    ShortRead(String),
    /// The block was stored for another model, KV layout, block size or TP size.
    #[error("stored under another compatibility key")]
    Compat,
    /// The block was stored under another hash, parent or token ids.
    #[error("stored under another key")]
    Key,
    /// A header field is out of bounds or the file is longer than a block.
    #[error("malformed block: {0}")]
    Malformed(String),
    /// Reading or writing failed.
    #[error("i/o: {0}")]
    Io(std::io::Error),
}

impl TierError {
    /// A stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            TierError::Missing => "missing",
            TierError::Checksum => "checksum",
            TierError::ShortRead(_) => "short_read",
            TierError::Compat => "compat",
            TierError::Key => "key",
            TierError::Malformed(_) => "malformed",
            TierError::Io(_) => "io",
        }
    }
}

impl From<std::io::Error> for TierError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::NotFound => TierError::Missing,
            std::io::ErrorKind::UnexpectedEof => TierError::ShortRead(e.to_string()),
            _ => TierError::Io(e),
        }
    }
}

/// Why the tiers could not open, and the `[kv_tiers]` key at fault.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {error}")]
pub struct TierOpenError {
    /// The config key.
    pub key: &'static str,
    /// What failed.
    #[source]
    pub error: TierError,
}

/// What to offer to the tiers when the pool evicts a block (`kv_tiers.write_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// Every evicted block.
    WriteBack,
    /// Only blocks reused (prefix-cache hits) at least this many times.
    Selective {
        /// Least reuse count.
        min_hits: u32,
    },
}

/// Capacities and places of the tiers (`[kv_tiers]`).
#[derive(Clone, Debug)]
pub struct TierSettings {
    /// Host spill region, in bytes (0: no host tier).
    pub host_capacity_bytes: u64,
    /// Disk tier directory (`None`: no disk tier).
    pub disk_dir: Option<PathBuf>,
    /// Disk tier capacity, in bytes.
    pub disk_capacity_bytes: u64,
    /// The shared store's directory (`None`: none, or on Redis).
    pub shared_dir: Option<PathBuf>,
    /// The shared store's Redis URL (`None`: none, or a directory).
    pub shared_url: Option<String>,
    /// Bytes this instance lets the shared store hold (LRU among the files it knows).
    pub shared_capacity_bytes: u64,
    /// What is written.
    pub write_policy: WritePolicy,
    /// How long a request waits for its blocks to load before it is computed without them
    /// (the disk tier then pauses for [`DISK_PAUSE`]).
    pub load_timeout: std::time::Duration,
    /// Whether a local request's restore streams layer by layer ([`stream`]): its first
    /// step starts once the blocks are opened, not once they are read.
    pub stream_layers: bool,
}

impl TierSettings {
    /// Only a host spill region of `bytes`: write-back, loads wait at most 30 s.
    pub fn host_only(bytes: u64) -> Self {
        Self {
            host_capacity_bytes: bytes,
            disk_dir: None,
            disk_capacity_bytes: 0,
            shared_dir: None,
            shared_url: None,
            shared_capacity_bytes: 0,
            write_policy: WritePolicy::WriteBack,
            load_timeout: std::time::Duration::from_secs(30),
            stream_layers: true,
        }
    }

    /// Only a disk tier of `bytes` in `dir`: write-back, loads wait at most 30 s.
    pub fn disk_only(dir: impl Into<PathBuf>, bytes: u64) -> Self {
        Self {
            host_capacity_bytes: 0,
            disk_dir: Some(dir.into()),
            disk_capacity_bytes: bytes,
            ..Self::host_only(0)
        }
    }
}

/// How long the disk tier stays off after a load ran past its timeout.
pub const DISK_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);

/// What one stored block must match: the instance's compatibility key and block geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierShape {
    /// The compatibility key (model, weights fingerprint, KV dtype, block size, TP size).
    pub compat: String,
    /// Tokens per block.
    pub block_size: usize,
    /// KV bytes of one block over every rank and layer.
    pub payload_bytes: usize,
    /// TP ranks (the payload is rank 0's bytes, then rank 1's, ...).
    pub tp: usize,
    /// Model layers (each rank's bytes are layer 0's K and V, then layer 1's, ...).
    pub layers: usize,
}

impl TierShape {
    /// The compatibility key's hash (names the disk tier's subdirectory).
    pub fn compat_hash(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(self.compat.as_bytes())
    }

    /// Bytes of one rank's share of a block.
    pub fn rank_bytes(&self) -> usize {
        self.payload_bytes / self.tp.max(1)
    }
}

/// One block as a tier stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierBlock {
    /// Its chained hash.
    pub hash: BlockHash,
    /// The previous block's hash (`None` for a first block).
    pub parent: Option<BlockHash>,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// Prefix-cache hits it had (the `selective` policy's count).
    pub hits: u32,
    /// KV bytes: each rank's share ([`KvCache::read_block`]) in rank order.
    pub bytes: Vec<u8>,
}

impl TierBlock {
    /// XXH3-64 of the bytes.
    pub fn checksum(&self) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&self.bytes)
    }

    /// Bytes a tier charges for it.
    pub fn footprint(&self) -> u64 {
        (self.bytes.len() + 4 * self.tokens.len() + 64) as u64
    }
}

/// The tiers, for labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// The host spill region.
    Host,
    /// The disk directory.
    Disk,
    /// The directory several instances share.
    Shared,
}

impl Tier {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Shared => "shared",
        }
    }
}

/// Counters of one tier.
#[derive(Debug, Default)]
struct TierCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    dropped_writes: AtomicU64,
    discarded: AtomicU64,
}

/// Figures of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierFigures {
    /// Blocks restored from this tier.
    pub hits: u64,
    /// Blocks the index listed whose restore failed verification (recomputed).
    pub misses: u64,
    /// Bytes stored into it.
    pub bytes_written: u64,
    /// Bytes restored from it.
    pub bytes_read: u64,
    /// Writes dropped (a full write queue, an I/O error, a block larger than the tier).
    pub dropped_writes: u64,
    /// Stored blocks found bad and removed (at start or on a restore).
    pub discarded: u64,
    /// Blocks it holds now.
    pub blocks: u64,
    /// Bytes it holds now.
    pub bytes: u64,
    /// Its capacity in bytes.
    pub capacity_bytes: u64,
}

/// Figures of every tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TiersFigures {
    /// The host spill region (`None`: off).
    pub host: Option<TierFigures>,
    /// The disk tier (`None`: off).
    pub disk: Option<TierFigures>,
    /// The shared store (`None`: off).
    pub shared: Option<TierFigures>,
    /// Evicted blocks offered to the tiers.
    pub offered: u64,
    /// Evicted blocks not copied out: a tier holds them already, the policy's filter, busy
    /// ranks or a worker restart.
    pub not_spilled: u64,
    /// Loads that ran past `kv_tiers.load_timeout_ms` (their requests were computed).
    pub load_timeouts: u64,
    /// Restores streamed layer by layer that landed verified ([`stream`]).
    pub streamed: u64,
    /// Layers of those that ranks computed on before the restore's last layer landed.
    pub early_layers: u64,
}

impl TiersFigures {
    /// Each tier with its figures (`None`: off), top down.
    pub fn each(&self) -> [(Tier, Option<TierFigures>); 3] {
        [
            (Tier::Host, self.host),
            (Tier::Disk, self.disk),
            (Tier::Shared, self.shared),
        ]
    }

    /// One line per tier that is on, for `pdserve inspect`.
    pub fn snapshots(&self) -> Vec<pdserve_runtime::supervision::TierSnapshot> {
        self.each()
            .into_iter()
            .filter_map(|(tier, f)| {
                f.map(|f| pdserve_runtime::supervision::TierSnapshot {
                    tier: tier.as_str().into(),
                    blocks: f.blocks,
                    bytes: f.bytes,
                    capacity_bytes: f.capacity_bytes,
                    hits: f.hits,
                    misses: f.misses,
                    bytes_written: f.bytes_written,
                    bytes_read: f.bytes_read,
                })
            })
            .collect()
    }
}

impl TierCounters {
    fn figures(&self, blocks: u64, bytes: u64, capacity_bytes: u64) -> TierFigures {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierFigures {
            hits: l(&self.hits),
            misses: l(&self.misses),
            bytes_written: l(&self.bytes_written),
            bytes_read: l(&self.bytes_read),
            dropped_writes: l(&self.dropped_writes),
            discarded: l(&self.discarded),
            blocks,
            bytes,
            capacity_bytes,
        }
    }

    fn hit(&self, tier: Tier, bytes: usize) {
        use pdserve_runtime::telemetry as m;
        self.hits.fetch_add(1, Ordering::Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Ordering::Relaxed);
        metrics::counter!(m::KV_TIER_HITS_TOTAL, m::LABEL_TIER => tier.as_str()).increment(1);
        metrics::counter!(m::KV_TIER_READ_BYTES_TOTAL, m::LABEL_TIER => tier.as_str())
            .increment(bytes as u64);
    }

    fn miss(&self, tier: Tier, hash: BlockHash, e: &TierError) {
        use pdserve_runtime::telemetry as m;
        self.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::KV_TIER_MISSES_TOTAL, m::LABEL_TIER => tier.as_str(), m::LABEL_REASON => e.kind())
            .increment(1);
        tracing::warn!(tier = tier.as_str(), block = format_args!("{hash:016x}"), error = %e, "KV tier restore failed verification: recomputing the block");
    }

    fn written(&self, tier: Tier, bytes: u64) {
        use pdserve_runtime::telemetry as m;
        self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        metrics::counter!(m::KV_TIER_WRITTEN_BYTES_TOTAL, m::LABEL_TIER => tier.as_str())
            .increment(bytes);
    }
}

/// The tiers of one instance.
pub struct KvTiers {
    shape: TierShape,
    policy: WritePolicy,
    salt: u64,
    host: Option<Mutex<host::HostTier>>,
    host_counters: TierCounters,
    disk: Option<DiskTier>,
    shared: Option<SharedStore>,
    offered: AtomicU64,
    not_spilled: AtomicU64,
    /// Spill and restore batches whose rank jobs have not all ended.
    jobs_in_flight: Arc<AtomicUsize>,
    load_timeout: std::time::Duration,
    stream_layers: bool,
    /// Until when the disk tier and the shared store are off (a load ran past its timeout).
    disk_paused_until: Mutex<Option<std::time::Instant>>,
    load_timeouts: AtomicU64,
    streamed: AtomicU64,
    early_layers: AtomicU64,
}

impl std::fmt::Debug for KvTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvTiers")
            .field("shape", &self.shape)
            .field("policy", &self.policy)
            .finish()
    }
}

/// Hashes one tier's KV-event snapshot lists at most: three tiers' snapshots (about 21 bytes
/// of JSON per hash) and the pool's stay well inside one 16 MiB control frame.
pub const MAX_TIER_SNAPSHOT: usize = 1 << 17;

/// Rank-job batches (spills and restores) in flight at most: each queues one job per rank
/// ahead of the next step, and a rank's queue must always have room for that step.
pub const MAX_JOBS_IN_FLIGHT: usize = 8;

impl KvTiers {
    /// Opens the tiers: the host region (empty) and the disk tier, whose index is rebuilt from
    /// its directory after verifying every file. Blocking (reads the directory): call it off
    /// the async threads. `salt` is the prefix cache's hash salt.
    ///
    /// # Errors
    /// [`TierError::Io`] when a directory cannot be created or listed, or a store thread
    /// cannot start; [`TierError::Malformed`] for a Redis URL the client refuses. The error
    /// names the `[kv_tiers]` key at fault.
    pub fn open(
        settings: TierSettings,
        shape: TierShape,
        salt: u64,
    ) -> Result<Self, TierOpenError> {
        let at = |key: &'static str| move |error| TierOpenError { key, error };
        let disk = match &settings.disk_dir {
            Some(dir) => Some(
                DiskTier::open(dir, settings.disk_capacity_bytes, shape.clone())
                    .map_err(at("kv_tiers.disk_dir"))?,
            ),
            None => None,
        };
        let shared = match (&settings.shared_dir, &settings.shared_url) {
            (Some(dir), _) => Some(SharedStore::Dir(
                DiskTier::open_dir(
                    dir,
                    settings.shared_capacity_bytes,
                    shape.clone(),
                    DirMode::Shared,
                )
                .map_err(at("kv_tiers.shared_dir"))?,
            )),
            (None, Some(url)) => Some(SharedStore::Redis(
                RedisTier::open(url, settings.shared_capacity_bytes, shape.clone())
                    .map_err(at("kv_tiers.shared_url"))?,
            )),
            (None, None) => None,
        };
        let host = (settings.host_capacity_bytes > 0)
            .then(|| Mutex::new(host::HostTier::new(settings.host_capacity_bytes)));
        Ok(Self {
            shape,
            policy: settings.write_policy,
            salt,
            host,
            host_counters: TierCounters::default(),
            disk,
            shared,
            offered: AtomicU64::new(0),
            not_spilled: AtomicU64::new(0),
            jobs_in_flight: Arc::new(AtomicUsize::new(0)),
            load_timeout: settings.load_timeout,
            stream_layers: settings.stream_layers,
            disk_paused_until: Mutex::new(None),
            load_timeouts: AtomicU64::new(0),
            streamed: AtomicU64::new(0),
            early_layers: AtomicU64::new(0),
        })
    }

    /// What stored blocks must match.
    pub fn shape(&self) -> &TierShape {
        &self.shape
    }

    /// The chained block hashes of `tokens` as this instance's prefix cache computes them.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        crate::block_manager::block_hashes(self.salt, tokens, self.shape.block_size)
    }

    /// The disk tier (tests and `inspect`).
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref()
    }

    /// The shared store (tests and `inspect`).
    pub fn shared(&self) -> Option<&SharedStore> {
        self.shared.as_ref()
    }

    /// Whether the directory tiers are paused after a slow load.
    fn paused(&self) -> bool {
        let paused = self
            .disk_paused_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        matches!(*paused, Some(until) if std::time::Instant::now() < until)
    }

    /// The disk tier unless it is paused after a slow load.
    fn live_disk(&self) -> Option<&DiskTier> {
        self.disk.as_ref().filter(|_| !self.paused())
    }

    /// The shared store unless it is paused after a slow load.
    fn live_shared(&self) -> Option<&SharedStore> {
        self.shared.as_ref().filter(|_| !self.paused())
    }

    /// A streamed restore landed verified; ranks took `early` of its layers before its last
    /// layer had landed.
    pub fn streamed(&self, early: usize) {
        self.streamed.fetch_add(1, Ordering::Relaxed);
        self.early_layers.fetch_add(early as u64, Ordering::Relaxed);
        metrics::counter!(pdserve_runtime::telemetry::KV_TIER_STREAM_EARLY_LAYERS_TOTAL)
            .increment(early as u64);
    }

    /// Whether local restores stream layer by layer (`kv_tiers.stream_layers`).
    pub fn streams(&self) -> bool {
        self.stream_layers
    }

    /// How long a request waits for a load.
    pub fn load_timeout(&self) -> std::time::Duration {
        self.load_timeout
    }

    /// A load ran past its timeout: the disk tier and the shared store turn themselves off
    /// for [`DISK_PAUSE`] (no lookups, no writes), then back on.
    pub fn load_timed_out(&self) {
        self.load_timeouts.fetch_add(1, Ordering::Relaxed);
        if self.disk.is_some() || self.shared.is_some() {
            *self
                .disk_paused_until
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now() + DISK_PAUSE);
            tracing::warn!(
                pause_s = DISK_PAUSE.as_secs(),
                timeout_ms = self.load_timeout.as_millis() as u64,
                "KV tier load ran past its timeout: request computed without it, disk tier and shared store paused"
            );
        }
    }

    fn host(&self) -> Option<std::sync::MutexGuard<'_, host::HostTier>> {
        self.host
            .as_ref()
            .map(|h| h.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the policy lets a block reused `hits` times into the tiers.
    pub fn admits(&self, hits: u32) -> bool {
        match self.policy {
            WritePolicy::WriteBack => true,
            WritePolicy::Selective { min_hits } => hits >= min_hits,
        }
    }

    /// Counts evicted blocks that were not copied out.
    pub fn not_spilled(&self, n: usize) {
        self.not_spilled.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Stores evicted blocks: into the host region (its LRU victims move on to disk), or
    /// straight to disk without one; every block also into the shared store (write-through).
    /// Never blocks on I/O (directory writes are queued).
    pub fn offer(&self, blocks: Vec<TierBlock>) {
        self.offered
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        for b in blocks {
            if b.bytes.len() != self.shape.payload_bytes {
                self.not_spilled(1);
                continue;
            }
            let b = Arc::new(b);
            let sum = b.checksum();
            if let Some(s) = self.live_shared() {
                if !s.contains(b.hash) {
                    s.write(b.clone(), sum);
                }
            }
            let to_disk = match self.host() {
                Some(mut h) => {
                    let (stored, victims) = h.insert(b.clone(), sum);
                    if stored {
                        self.host_counters.written(Tier::Host, b.footprint());
                    } else {
                        self.host_counters
                            .dropped_writes
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    victims
                }
                None => vec![(b, sum)],
            };
            if let Some(d) = self.live_disk() {
                for (v, sum) in to_disk {
                    d.write(v, sum);
                }
            }
        }
        self.publish();
    }

    /// How many leading blocks of `hashes` the tiers hold (by their indexes; a restore still
    /// verifies each).
    pub fn contains_run(&self, hashes: &[BlockHash]) -> usize {
        let host = self.host();
        hashes
            .iter()
            .take_while(|h| {
                host.as_ref().is_some_and(|t| t.contains(**h))
                    || self.live_disk().is_some_and(|d| d.contains(**h))
                    || self.live_shared().is_some_and(|d| d.contains(**h))
            })
            .count()
    }

    /// Whether a tier holds block `h` already (an evicted block that needs no second copy).
    /// With a shared store, only when it holds the block too (it is written through).
    pub fn holds(&self, h: BlockHash) -> bool {
        let local = self.host().is_some_and(|t| t.contains(h))
            || self.disk.as_ref().is_some_and(|d| d.contains(h));
        local && self.shared.as_ref().is_none_or(|s| s.contains(h))
    }

    /// Loads and verifies the blocks `hashes` (with their token ids `tokens`, block by block;
    /// the first one's parent is `parent`) from the host region, else from disk, stopping at
    /// the first that cannot be restored (a miss, counted and logged); a block neither holds
    /// comes from the shared store. Blocking (disk reads): call it off the async threads.
    pub fn load_run(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        parent: Option<BlockHash>,
    ) -> Vec<Arc<TierBlock>> {
        self.open_run(hashes, tokens, parent, false)
            .into_iter()
            .filter_map(|s| match s {
                Source::Whole(b) => Some(b),
                Source::File { .. } => None, // not opened unless streamed
            })
            .collect()
    }

    /// As [`KvTiers::load_run`] for a restore streamed layer by layer ([`stream`]): the host
    /// region's and the Redis store's blocks are read and verified whole, the files of the
    /// disk tier and the shared directory only opened (header and key checked). The returned
    /// load's [`StreamLoad::run`] reads the layers; waits on its stream end at `deadline`.
    /// `hold_last` is the test-only `faults.tier_stream_hold`. Blocking.
    pub fn open_stream(
        self: &Arc<Self>,
        hashes: &[BlockHash],
        tokens: &[u32],
        parent: Option<BlockHash>,
        deadline: std::time::Instant,
        hold_last: bool,
    ) -> StreamLoad {
        let sources = self.open_run(hashes, tokens, parent, true);
        let s = &self.shape;
        let layer_bytes = s.rank_bytes() / s.layers.max(1);
        StreamLoad {
            tiers: self.clone(),
            stream: Arc::new(RestoreStream::new(
                sources.len(),
                s.layers,
                s.tp,
                layer_bytes,
                deadline,
            )),
            sources,
            hold_last,
        }
    }

    /// The leading blocks of a run that can be restored (see [`KvTiers::load_run`]); with
    /// `stream`, the disk tier's and the shared directory's files are opened, not read.
    fn open_run(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        parent: Option<BlockHash>,
        stream: bool,
    ) -> Vec<Source> {
        let bs = self.shape.block_size;
        let mut out = Vec::new();
        let mut parent = parent;
        for (i, &h) in hashes.iter().enumerate() {
            let Some(want) = tokens.get(i * bs..(i + 1) * bs) else {
                break;
            };
            let key = |p: Option<BlockHash>, t: &[u32]| -> Result<(), TierError> {
                if p != parent || t != want {
                    return Err(TierError::Key);
                }
                Ok(())
            };
            let check = |b: &TierBlock| -> Result<(), TierError> {
                if b.hash != h {
                    return Err(TierError::Key);
                }
                key(b.parent, &b.tokens)?;
                if b.bytes.len() != self.shape.payload_bytes {
                    return Err(TierError::ShortRead(format!(
                        "{} of {} bytes",
                        b.bytes.len(),
                        self.shape.payload_bytes
                    )));
                }
                Ok(())
            };
            let from_host = self.host().and_then(|mut t| t.get(h));
            let found = match from_host {
                Some((b, sum)) => {
                    let verdict = if b.checksum() != sum {
                        Err(TierError::Checksum)
                    } else {
                        check(&b)
                    };
                    match verdict {
                        Ok(()) => {
                            self.host_counters.hit(Tier::Host, b.bytes.len());
                            Some(Source::Whole(b))
                        }
                        Err(e) => {
                            self.host_counters.miss(Tier::Host, h, &e);
                            self.host_counters.discarded.fetch_add(1, Ordering::Relaxed);
                            if let Some(mut t) = self.host() {
                                t.remove(h);
                            }
                            None
                        }
                    }
                }
                None => None,
            };
            let open = |d: &DiskTier, shared: bool| -> Option<Source> {
                if !d.contains(h) {
                    return None;
                }
                match d
                    .open_block(h)
                    .and_then(|(p, t, file)| key(p, &t).map(|()| file))
                {
                    Ok(file) => Some(Source::File {
                        hash: h,
                        shared,
                        file,
                    }),
                    Err(e) => {
                        d.counters().miss(DiskTier::tier(d), h, &e);
                        DiskTier::discard(d, h);
                        None
                    }
                }
            };
            let shared_dir = self.live_shared().and_then(SharedStore::as_dir);
            let found = found
                .or_else(|| match (stream, self.live_disk()) {
                    (true, Some(d)) => open(d, false),
                    _ => restore_from(self.live_disk(), h, &check).map(Source::Whole),
                })
                .or_else(|| match (stream, shared_dir) {
                    (true, Some(d)) => open(d, true),
                    _ => restore_from(self.live_shared(), h, &check).map(Source::Whole),
                });
            let Some(b) = found else { break };
            parent = Some(h);
            out.push(b);
        }
        self.publish();
        out
    }

    /// The figures of every tier.
    pub fn figures(&self) -> TiersFigures {
        TiersFigures {
            host: self.host().map(|h| {
                self.host_counters
                    .figures(h.len() as u64, h.used(), h.capacity())
            }),
            disk: self.disk.as_ref().map(DiskTier::figures),
            shared: self.shared.as_ref().map(SharedStore::figures),
            offered: self.offered.load(Ordering::Relaxed),
            not_spilled: self.not_spilled.load(Ordering::Relaxed),
            load_timeouts: self.load_timeouts.load(Ordering::Relaxed),
            streamed: self.streamed.load(Ordering::Relaxed),
            early_layers: self.early_layers.load(Ordering::Relaxed),
        }
    }

    /// Sets the per-tier gauges.
    fn publish(&self) {
        use pdserve_runtime::telemetry as m;
        let f = self.figures();
        for (tier, t) in f.each() {
            if let Some(t) = t {
                metrics::gauge!(m::KV_TIER_BLOCKS, m::LABEL_TIER => tier.as_str())
                    .set(t.blocks as f64);
                metrics::gauge!(m::KV_TIER_BYTES, m::LABEL_TIER => tier.as_str())
                    .set(t.bytes as f64);
            }
        }
    }

    /// A clean stop: writes what the host region holds and the disk tier lacks to disk
    /// (oldest first, so the most recent are the last an LRU trim would drop) and waits for
    /// the disk writes, all before `deadline`; returns the blocks queued. The host region
    /// dies with the process, so without this a restart would find only what had overflowed
    /// to disk. (The shared store was written through already.) Blocking.
    pub fn persist(&self, deadline: std::time::Instant) -> usize {
        let (Some(disk), Some(blocks)) = (self.disk.as_ref(), self.host().map(|h| h.all())) else {
            return 0;
        };
        let mut queued = 0;
        for (b, sum) in blocks {
            if std::time::Instant::now() >= deadline {
                break;
            }
            if disk.contains(b.hash) || b.checksum() != sum {
                continue;
            }
            if !disk.write_waiting(b) {
                break;
            }
            queued += 1;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if !disk.flush(left) {
            tracing::warn!(
                queued,
                "KV tiers: the stop's disk writes did not end in time"
            );
        }
        queued
    }

    /// Each tier's hashes stored and dropped since the last call, for the proxy's KV index
    /// (`kv_events`: the host region, the disk tier and, for the shared store, what this
    /// instance's index of it lists, whoever wrote it). A tier's first call, and every call
    /// with `snapshot`, lists what it holds, at most [`MAX_TIER_SNAPSHOT`] hashes (the batch
    /// must fit one control frame; the proxy then under-reports, never over-reports). A tier
    /// without events is left out.
    pub fn kv_events(&self, snapshot: bool) -> Vec<TierEvents> {
        let mut out = Vec::with_capacity(3);
        let mut push = |medium, mut batch: crate::kv_events::KvEventBatch| {
            if let Some(all) = batch.snapshot.as_mut() {
                all.truncate(MAX_TIER_SNAPSHOT);
            }
            if !batch.is_empty() {
                out.push(TierEvents::new(medium, batch));
            }
        };
        if let Some(mut h) = self.host() {
            push(Medium::Host, h.kv_events(snapshot));
        }
        if let Some(d) = &self.disk {
            push(Medium::Disk, d.kv_events(snapshot));
        }
        match &self.shared {
            Some(SharedStore::Dir(d)) => push(Medium::Shared, d.kv_events(snapshot)),
            Some(SharedStore::Redis(r)) => push(Medium::Shared, r.kv_events(snapshot)),
            None => {}
        }
        out
    }

    /// Whether another rank-job batch may start (see [`MAX_JOBS_IN_FLIGHT`]).
    pub fn may_queue_jobs(&self) -> bool {
        self.jobs_in_flight.load(Ordering::Acquire) < MAX_JOBS_IN_FLIGHT
    }
}

/// The shared store: a directory or a Redis server.
#[derive(Debug)]
pub enum SharedStore {
    /// A directory several instances read and write.
    Dir(DiskTier),
    /// A Redis (or Valkey) server.
    Redis(RedisTier),
}

impl SharedStore {
    /// The directory store (`None` on Redis).
    pub fn as_dir(&self) -> Option<&DiskTier> {
        match self {
            SharedStore::Dir(d) => Some(d),
            SharedStore::Redis(_) => None,
        }
    }

    /// The Redis store (`None` for a directory).
    pub fn as_redis(&self) -> Option<&RedisTier> {
        match self {
            SharedStore::Redis(r) => Some(r),
            SharedStore::Dir(_) => None,
        }
    }

    /// Whether it holds `h`, by what this instance knows (see each store's docs).
    pub fn contains(&self, h: BlockHash) -> bool {
        match self {
            SharedStore::Dir(d) => d.contains(h),
            SharedStore::Redis(r) => r.contains(h),
        }
    }

    /// Its figures.
    pub fn figures(&self) -> TierFigures {
        match self {
            SharedStore::Dir(d) => d.figures(),
            SharedStore::Redis(r) => r.figures(),
        }
    }

    /// Waits (at most `timeout`) for the writes queued before this call. Blocking.
    pub fn flush(&self, timeout: std::time::Duration) -> bool {
        match self {
            SharedStore::Dir(d) => d.flush(timeout),
            SharedStore::Redis(r) => r.flush(timeout),
        }
    }

    fn write(&self, b: Arc<TierBlock>, sum: u64) {
        match self {
            SharedStore::Dir(d) => d.write(b, sum),
            SharedStore::Redis(r) => r.write(b),
        }
    }
}

/// A tier below the host region that restores blocks by hash (the disk tier, the shared store).
trait BlockStore {
    fn tier(&self) -> Tier;
    fn contains(&self, h: BlockHash) -> bool;
    fn read(&self, h: BlockHash) -> Result<TierBlock, TierError>;
    fn counters(&self) -> &TierCounters;
    fn discard(&self, h: BlockHash);
}

impl BlockStore for DiskTier {
    fn tier(&self) -> Tier {
        DiskTier::tier(self)
    }
    fn contains(&self, h: BlockHash) -> bool {
        DiskTier::contains(self, h)
    }
    fn read(&self, h: BlockHash) -> Result<TierBlock, TierError> {
        DiskTier::read(self, h)
    }
    fn counters(&self) -> &TierCounters {
        DiskTier::counters(self)
    }
    fn discard(&self, h: BlockHash) {
        DiskTier::discard(self, h)
    }
}

impl BlockStore for SharedStore {
    fn tier(&self) -> Tier {
        Tier::Shared
    }
    fn contains(&self, h: BlockHash) -> bool {
        SharedStore::contains(self, h)
    }
    fn read(&self, h: BlockHash) -> Result<TierBlock, TierError> {
        match self {
            SharedStore::Dir(d) => d.read(h),
            SharedStore::Redis(r) => r.read(h),
        }
    }
    fn counters(&self) -> &TierCounters {
        match self {
            SharedStore::Dir(d) => d.counters(),
            SharedStore::Redis(r) => r.counters(),
        }
    }
    fn discard(&self, h: BlockHash) {
        match self {
            SharedStore::Dir(d) => d.discard(h),
            SharedStore::Redis(r) => r.discard(h),
        }
    }
}

/// Restores block `h` from `store` if it lists it: read, verified (`check`: its key), counted
/// as a hit; a block that fails is a miss, counted, logged and discarded.
fn restore_from<S: BlockStore>(
    store: Option<&S>,
    h: BlockHash,
    check: &dyn Fn(&TierBlock) -> Result<(), TierError>,
) -> Option<Arc<TierBlock>> {
    let s = store.filter(|s| s.contains(h))?;
    match s.read(h).and_then(|b| {
        check(&b)?;
        Ok(b)
    }) {
        Ok(b) => {
            s.counters().hit(s.tier(), b.bytes.len());
            Some(Arc::new(b))
        }
        Err(e) => {
            s.counters().miss(s.tier(), h, &e);
            s.discard(h);
            None
        }
    }
}

/// Counts one batch of rank jobs in flight until dropped.
struct JobTicket(Arc<AtomicUsize>);

impl JobTicket {
    fn new(c: &Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::AcqRel);
        Self(c.clone())
    }
}

impl Drop for JobTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a spill's rank jobs run once the last one ended or was dropped unrun: the pool
/// blocks they read may be rewritten from then on (the copies are the batch's own).
pub type SpillDone = Box<dyn FnOnce() + Send>;

/// The ranks' copies of a batch of evicted blocks; offered to the tiers when the last rank's
/// job ends (or is dropped unrun: then nothing is offered).
struct SpillBatch {
    entries: Vec<Evicted>,
    /// Per rank, its share of each entry's bytes (one buffer per block: with one rank they
    /// become the blocks as they are, without a second copy).
    parts: Mutex<Vec<Option<Vec<Vec<u8>>>>>,
    tiers: Arc<KvTiers>,
    done: Mutex<Option<SpillDone>>,
    _ticket: JobTicket,
}

impl Drop for SpillBatch {
    fn drop(&mut self) {
        // Every rank's read of the pool ended with its job: whoever waits may write the
        // blocks now, while the copies are checksummed and stored.
        let done = self
            .done
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(done) = done {
            done();
        }
        self.offer();
    }
}

impl SpillBatch {
    /// Joins the ranks' copies into blocks and offers them to the tiers; an incomplete batch
    /// (a rank dropped its job or has another layout) offers nothing.
    fn offer(&mut self) {
        let parts = std::mem::take(&mut *self.parts.lock().unwrap_or_else(|e| e.into_inner()));
        let rb = self.tiers.shape.rank_bytes();
        let n = self.entries.len();
        if parts.iter().any(|p| {
            p.as_ref()
                .is_none_or(|p| p.len() != n || p.iter().any(|b| b.len() != rb))
        }) {
            self.tiers.not_spilled(n);
            return;
        }
        // Rank-major to block-major: block `i`'s bytes are each rank's share in rank order.
        let mut ranks: Vec<std::vec::IntoIter<Vec<u8>>> =
            parts.into_iter().flatten().map(Vec::into_iter).collect();
        let blocks = std::mem::take(&mut self.entries)
            .into_iter()
            .map(|e| {
                let bytes = match ranks.as_mut_slice() {
                    [one] => one.next().expect("n blocks per rank"),
                    all => {
                        let mut bytes = Vec::with_capacity(rb * all.len());
                        for r in all.iter_mut() {
                            bytes.extend_from_slice(&r.next().expect("n blocks per rank"));
                        }
                        bytes
                    }
                };
                TierBlock {
                    hash: e.hash,
                    parent: e.parent,
                    tokens: e.tokens,
                    hits: e.hits,
                    bytes,
                }
            })
            .collect();
        self.tiers.offer(blocks);
    }
}

/// One job per rank copying the evicted blocks `entries` out of its cache; the copies reach
/// the tiers when every rank's job ran, and `done` runs after that. Queue each on its rank
/// before any job that writes those blocks (the step that reuses them); a writer off the
/// ranks' queues (a KV transfer landing) waits for `done`.
pub fn spill_jobs(tiers: &Arc<KvTiers>, entries: Vec<Evicted>, done: SpillDone) -> Vec<KvJob> {
    let tp = tiers.shape.tp;
    let batch = Arc::new(SpillBatch {
        entries,
        parts: Mutex::new(vec![None; tp]),
        tiers: tiers.clone(),
        done: Mutex::new(Some(done)),
        _ticket: JobTicket::new(&tiers.jobs_in_flight),
    });
    (0..tp)
        .map(|rank| {
            let batch = batch.clone();
            let job: KvJob = Box::new(move |kv: &mut KvCache| {
                if kv.block_bytes_all_layers() != batch.tiers.shape.rank_bytes() {
                    return; // another layout: the batch is incomplete, nothing is offered
                }
                let started = std::time::Instant::now();
                let rb = kv.block_bytes_all_layers();
                let blocks = kv.layout().num_blocks;
                if batch.entries.iter().all(|e| (e.block as usize) < blocks) {
                    let bufs = batch
                        .entries
                        .iter()
                        .map(|e| {
                            let mut buf = Vec::with_capacity(rb);
                            kv.read_block(e.block as usize, &mut buf);
                            buf
                        })
                        .collect();
                    batch.parts.lock().unwrap_or_else(|e| e.into_inner())[rank] = Some(bufs);
                }
                // The last rank's drop offers the batch to the tiers (checksums, the host
                // region's copy): on this thread too, so it is timed with the copy.
                drop(batch);
                metrics::histogram!(pdserve_runtime::telemetry::KV_TIER_SPILL_SECONDS)
                    .record(started.elapsed().as_secs_f64());
            });
            job
        })
        .collect()
}

/// What a restore's rank jobs report when the last one ended: whether every rank wrote
/// every block.
pub type RestoreDone = Box<dyn FnOnce(bool) + Send>;

struct RestoreBatch {
    items: Vec<(u32, Arc<TierBlock>)>,
    rank_bytes: usize,
    ranks_done: AtomicUsize,
    tp: usize,
    done: Mutex<Option<RestoreDone>>,
    _ticket: JobTicket,
}

impl Drop for RestoreBatch {
    fn drop(&mut self) {
        let ok = self.ranks_done.load(Ordering::Acquire) == self.tp;
        if let Some(done) = self.done.lock().unwrap_or_else(|e| e.into_inner()).take() {
            done(ok);
        }
    }
}

/// One job per rank writing its share of each restored block into pool block `items[i].0`;
/// `done(all ranks wrote)` is called once the last job ended or was dropped unrun. The caller
/// keeps the blocks allocated until then (a job may still write them).
pub fn restore_jobs(
    tiers: &Arc<KvTiers>,
    items: Vec<(u32, Arc<TierBlock>)>,
    done: RestoreDone,
) -> Vec<KvJob> {
    let tp = tiers.shape.tp;
    let batch = Arc::new(RestoreBatch {
        items,
        rank_bytes: tiers.shape.rank_bytes(),
        ranks_done: AtomicUsize::new(0),
        tp,
        done: Mutex::new(Some(done)),
        _ticket: JobTicket::new(&tiers.jobs_in_flight),
    });
    (0..tp)
        .map(|rank| {
            let batch = batch.clone();
            let job: KvJob = Box::new(move |kv: &mut KvCache| {
                let rb = batch.rank_bytes;
                if kv.block_bytes_all_layers() != rb {
                    return;
                }
                for (block, b) in &batch.items {
                    if (*block as usize) >= kv.layout().num_blocks
                        || b.bytes.len() < (rank + 1) * rb
                    {
                        return;
                    }
                    kv.write_block(*block as usize, &b.bytes[rank * rb..(rank + 1) * rb]);
                }
                batch.ranks_done.fetch_add(1, Ordering::AcqRel);
            });
            job
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn shape() -> TierShape {
        TierShape {
            compat: "test compat".into(),
            block_size: 4,
            payload_bytes: 64,
            tp: 2,
            layers: 2,
        }
    }

    pub(crate) fn block(hash: u64, parent: Option<u64>, fill: u8) -> TierBlock {
        TierBlock {
            hash,
            parent,
            tokens: vec![hash as u32; 4],
            hits: 0,
            bytes: vec![fill; 64],
        }
    }

    fn settings(host: u64, disk: Option<PathBuf>) -> TierSettings {
        TierSettings {
            host_capacity_bytes: host,
            disk_dir: disk,
            disk_capacity_bytes: 1 << 20,
            shared_dir: None,
            shared_url: None,
            shared_capacity_bytes: 0,
            write_policy: WritePolicy::WriteBack,
            load_timeout: std::time::Duration::from_secs(1),
            stream_layers: true,
        }
    }

    #[test]
    fn host_hits_verify_keys_and_lru_overflows_to_disk() {
        let dir = tempfile::tempdir().unwrap();
        let one = block(1, None, 0).footprint();
        let t = KvTiers::open(settings(2 * one, Some(dir.path().into())), shape(), 0).unwrap();
        t.offer(vec![
            block(1, None, 1),
            block(2, Some(1), 2),
            block(3, Some(2), 3),
        ]);
        let f = t.figures();
        assert_eq!(f.host.unwrap().blocks, 2, "two fit the host region");
        // The oldest moved on to disk (written by the disk thread).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !t.disk().unwrap().contains(1) {
            assert!(
                std::time::Instant::now() < deadline,
                "block 1 never reached disk"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(t.contains_run(&[1, 2, 3, 4]), 3);
        let toks: Vec<u32> = [1u32, 2, 3].iter().flat_map(|&h| [h; 4]).collect();
        let got = t.load_run(&[1, 2, 3], &toks, None);
        assert_eq!(got.len(), 3);
        assert_eq!(got[2].bytes, vec![3; 64]);
        let f = t.figures();
        assert_eq!((f.host.unwrap().hits, f.disk.unwrap().hits), (2, 1));
        // A wrong parent is another key: a miss, and the run stops there.
        let got = t.load_run(&[2], &toks[4..8], Some(99));
        assert!(got.is_empty());
        assert_eq!(t.figures().host.unwrap().misses, 1);
    }

    #[test]
    fn a_block_one_instance_offers_is_restored_by_another_from_the_shared_store() {
        let dir = tempfile::tempdir().unwrap();
        let shared = |host| TierSettings {
            shared_dir: Some(dir.path().into()),
            shared_capacity_bytes: 1 << 20,
            ..settings(host, None)
        };
        let one = block(1, None, 0).footprint();
        // Both open the store before anything is in it: b learns of a's blocks from its listing.
        let a = KvTiers::open(shared(4 * one), shape(), 0).unwrap();
        let b = KvTiers::open(shared(0), shape(), 0).unwrap();
        // Another writer's temporary file in progress survives b's open; an old one is a
        // write cut off by a stop and goes.
        let sub = a.shared().unwrap().as_dir().unwrap().dir().to_path_buf();
        let (young, old) = (sub.join(".00.1.0.tmp"), sub.join(".00.2.0.tmp"));
        std::fs::write(&young, b"partial").unwrap();
        std::fs::write(&old, b"partial").unwrap();
        let f = std::fs::File::options().write(true).open(&old).unwrap();
        f.set_modified(std::time::SystemTime::now() - 2 * disk::STALE_TMP)
            .unwrap();
        drop(f);
        let c = KvTiers::open(shared(0), shape(), 0).unwrap();
        assert!(young.exists() && !old.exists());
        drop(c);

        a.offer(vec![block(1, None, 1), block(2, Some(1), 2)]);
        assert!(a.shared().unwrap().flush(std::time::Duration::from_secs(5)));
        assert_eq!(
            a.figures().host.unwrap().blocks,
            2,
            "a keeps its own copies too"
        );
        // b's thread lists the directory (every 500 ms; a flush does it now).
        assert!(b.shared().unwrap().flush(std::time::Duration::from_secs(5)));
        assert_eq!(b.contains_run(&[1, 2, 3]), 2);
        let toks: Vec<u32> = [1u32, 2].iter().flat_map(|&h| [h; 4]).collect();
        let got = b.load_run(&[1, 2], &toks, None);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].bytes, vec![2; 64]);
        let f = b.figures();
        assert_eq!(f.shared.unwrap().hits, 2, "{f:?}");
        assert!(f.host.is_none() && f.disk.is_none());
        assert_eq!(
            a.figures().shared.unwrap().bytes_written,
            2 * disk::encode(&shape(), &block(1, None, 1)).len() as u64
        );
        // A block a writes again is not written twice; one b damages is a miss for a too.
        a.offer(vec![block(1, None, 1)]);
        assert!(a.shared().unwrap().flush(std::time::Duration::from_secs(5)));
        assert_eq!(a.figures().shared.unwrap().blocks, 2);
        let file = b.shared().unwrap().as_dir().unwrap().file_of(2);
        let mut bytes = std::fs::read(&file).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        let fresh = KvTiers::open(shared(0), shape(), 0).unwrap();
        assert_eq!(
            fresh.figures().shared.unwrap().discarded,
            1,
            "verified at open"
        );
        assert_eq!(
            b.load_run(&[1, 2], &toks, None).len(),
            1,
            "the damaged block is a miss"
        );
        assert_eq!(b.figures().shared.unwrap().misses, 1);
    }

    #[test]
    fn a_stop_persists_the_host_region_to_disk() {
        let dir = tempfile::tempdir().unwrap();
        let one = block(1, None, 0).footprint();
        let t = KvTiers::open(settings(8 * one, Some(dir.path().into())), shape(), 0).unwrap();
        t.offer(vec![block(1, None, 1), block(2, Some(1), 2)]);
        assert!(t.disk().unwrap().flush(std::time::Duration::from_secs(5)));
        assert_eq!(
            t.figures().disk.unwrap().blocks,
            0,
            "all fit the host region"
        );
        let soon = std::time::Instant::now() + std::time::Duration::from_secs(10);
        assert_eq!(t.persist(soon), 2);
        assert_eq!(t.persist(soon), 0, "what is on disk is not written twice");
        drop(t);
        let again = KvTiers::open(settings(8 * one, Some(dir.path().into())), shape(), 0).unwrap();
        assert_eq!(
            again.contains_run(&[1, 2]),
            2,
            "a restart finds them on disk"
        );
        // Without a disk tier there is nothing to persist to.
        let host_only = KvTiers::open(settings(8 * one, None), shape(), 0).unwrap();
        host_only.offer(vec![block(1, None, 1)]);
        assert_eq!(host_only.persist(soon), 0);
    }

    #[test]
    fn a_slow_load_pauses_the_disk_tier() {
        let dir = tempfile::tempdir().unwrap();
        let t = KvTiers::open(settings(0, Some(dir.path().into())), shape(), 0).unwrap();
        t.offer(vec![block(1, None, 1)]);
        assert!(t.disk().unwrap().flush(std::time::Duration::from_secs(5)));
        assert_eq!(t.contains_run(&[1]), 1);
        t.load_timed_out();
        assert_eq!(t.contains_run(&[1]), 0, "paused: no lookups");
        t.offer(vec![block(2, Some(1), 2)]);
        assert!(t.disk().unwrap().flush(std::time::Duration::from_secs(5)));
        assert!(!t.disk().unwrap().contains(2), "paused: no writes");
        assert_eq!(t.figures().load_timeouts, 1);
    }

    #[test]
    fn each_tier_reports_what_it_gains_and_drops_as_kv_events() {
        use crate::kv_events::KvOp;
        let dir = tempfile::tempdir().unwrap();
        let one = block(1, None, 0).footprint();
        let t = KvTiers::open(settings(2 * one, Some(dir.path().into())), shape(), 0).unwrap();
        let medium = |e: &[TierEvents], m: &str| e.iter().find(|t| t.medium == m).cloned();
        // The first drain is a snapshot of each tier (empty here).
        let first = t.kv_events(false);
        assert_eq!(medium(&first, "host").unwrap().snapshot, Some(vec![]));
        assert_eq!(medium(&first, "disk").unwrap().snapshot, Some(vec![]));
        assert!(t.kv_events(false).is_empty(), "nothing happened since");
        // Three blocks into a two-block host region: the oldest moves on to disk.
        t.offer(vec![
            block(1, None, 1),
            block(2, Some(1), 2),
            block(3, Some(2), 3),
        ]);
        assert!(t.disk().unwrap().flush(std::time::Duration::from_secs(5)));
        let e = t.kv_events(false);
        assert_eq!(
            medium(&e, "host").unwrap().ops,
            vec![
                KvOp::Stored(vec![1, 2]),
                KvOp::Removed(vec![1]),
                KvOp::Stored(vec![3])
            ]
        );
        assert_eq!(medium(&e, "disk").unwrap().ops, vec![KvOp::Stored(vec![1])]);
        // A snapshot on demand lists what each holds.
        let snap = t.kv_events(true);
        let mut host = medium(&snap, "host").unwrap().snapshot.unwrap();
        host.sort();
        assert_eq!(host, vec![2, 3]);
        assert_eq!(medium(&snap, "disk").unwrap().snapshot, Some(vec![1]));
        // A block that fails verification is dropped, and reported dropped.
        let toks: Vec<u32> = [2u32; 4].to_vec();
        assert!(t.load_run(&[2], &toks, Some(99)).is_empty());
        let e = t.kv_events(false);
        assert_eq!(
            medium(&e, "host").unwrap().ops,
            vec![KvOp::Removed(vec![2])]
        );
    }

    #[test]
    fn selective_policy_filters_by_hits() {
        let mut s = settings(1 << 20, None);
        s.write_policy = WritePolicy::Selective { min_hits: 2 };
        let t = KvTiers::open(s, shape(), 0).unwrap();
        assert!(!t.admits(1));
        assert!(t.admits(2));
    }
}
