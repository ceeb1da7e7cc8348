//! The shared store on a Redis (or Valkey) server (`kv_tiers.shared_url`): one key per block,
//! `pdserve:kv:<compat hash>:<block hash>`, whose value is the disk tier's block record
//! (header, token ids, payload, XXH3-64; [`super::disk::encode`]), so a restore verifies it
//! exactly as a file.
//!
//! The Scheduler asks "which of these blocks does the store hold?" on its own thread, so that
//! question never goes to the network: it is answered from an **index** of keys this instance
//! knows — the ones it wrote, plus what a periodic `SCAN` of the store's keys found (every
//! [`REFRESH`], by the store thread), which is how one instance learns of another's blocks.
//! A key the index lists but the store lost (evicted by the server's `maxmemory` policy,
//! deleted) is a miss on restore, like a missing file.
//!
//! One named thread (`pdserve-kv-redis`) does the writes (`SET … NX`: a block another
//! instance stored first is not rewritten) behind a bounded queue, the refreshes, and the
//! trimming of what this instance wrote to `shared_capacity_bytes` (LRU, `DEL`). Reads run in
//! the caller's blocking task on pooled connections. Every command has a [`TIMEOUT`].
//!
//! **The store being down never stalls serving.** A failed connect or command marks the store
//! down for [`DOWN_PAUSE`] with one warning: lookups answer "not held", writes are dropped
//! (counted), restores already under way are misses; then the next command tries again, and
//! the first that succeeds logs that the store is back.

use super::disk::{decode, encode, Index};
use super::queue::{Job, WriteQueue};
use super::{Tier, TierBlock, TierCounters, TierError, TierFigures, TierShape};
use crate::block_manager::BlockHash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connect, read and write timeout of every command.
pub const TIMEOUT: Duration = Duration::from_millis(500);
/// How long the store stays off after a failed command.
pub const DOWN_PAUSE: Duration = Duration::from_secs(5);
/// How often the index is refreshed from the store's keys.
pub const REFRESH: Duration = Duration::from_millis(500);
/// Writes queued at most; past that a write is dropped (counted).
const WRITE_QUEUE: usize = 256;
/// Keys asked per `SCAN` step.
const SCAN_COUNT: usize = 1000;
/// Idle read connections kept.
const READ_POOL: usize = 4;

struct Inner {
    client: redis::Client,
    /// `pdserve:kv:<compat hash>:`.
    prefix: String,
    shape: TierShape,
    capacity: u64,
    /// Keys known to be stored (see the module docs), LRU.
    index: Mutex<Index>,
    /// Keys this instance wrote, LRU: what it trims to its capacity.
    mine: Mutex<Index>,
    counters: TierCounters,
    down_until: Mutex<Option<Instant>>,
    /// Whether the last failure was reported and not yet followed by a success.
    reported_down: AtomicBool,
    /// Times the store was found down.
    outages: std::sync::atomic::AtomicU64,
    reads: Mutex<Vec<redis::Connection>>,
}

impl Inner {
    fn key(&self, h: BlockHash) -> String {
        format!("{}{h:016x}", self.prefix)
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mine(&self) -> std::sync::MutexGuard<'_, Index> {
        self.mine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_down(&self) -> bool {
        let d = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        matches!(*d, Some(until) if Instant::now() < until)
    }

    fn failed(&self, what: &str, e: &redis::RedisError) {
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + DOWN_PAUSE);
        if !self.reported_down.swap(true, Ordering::Relaxed) {
            self.outages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                error = %e,
                during = what,
                pause_s = DOWN_PAUSE.as_secs(),
                "KV shared store (Redis) unreachable: lookups and writes off, serving goes on"
            );
        }
    }

    fn succeeded(&self) {
        if self.reported_down.swap(false, Ordering::Relaxed) {
            // The server may have restarted empty: what the index listed is relearned by
            // the next scan.
            *self.index() = Index::logged();
            tracing::info!("KV shared store (Redis) reachable again");
        }
    }

    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let con = self.client.get_connection_with_timeout(TIMEOUT)?;
        con.set_read_timeout(Some(TIMEOUT))?;
        con.set_write_timeout(Some(TIMEOUT))?;
        Ok(con)
    }

    /// Runs `f` on a pooled connection (a new one when the pool is empty); a connection that
    /// failed is dropped, one that worked goes back.
    fn with_con<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Option<T> {
        if self.is_down() {
            return None;
        }
        let pooled = self.reads.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut con = match pooled.map_or_else(|| self.connect(), Ok) {
            Ok(c) => c,
            Err(e) => {
                self.failed(what, &e);
                return None;
            }
        };
        match f(&mut con) {
            Ok(v) => {
                self.succeeded();
                let mut pool = self.reads.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < READ_POOL {
                    pool.push(con);
                }
                Some(v)
            }
            Err(e) => {
                self.failed(what, &e);
                None
            }
        }
    }

    /// Stores one block (the store thread).
    fn store(&self, b: &TierBlock) {
        if self.index().files.contains_key(&b.hash) {
            self.index().touch(b.hash);
            return;
        }
        let bytes = encode(&self.shape, b);
        let len = bytes.len() as u64;
        if len > self.capacity {
            self.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let key = self.key(b.hash);
        let stored = self.with_con("write", |c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(&bytes)
                .arg("NX")
                .query::<Option<String>>(c)
        });
        match stored {
            None => {
                self.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Some(Some(_)) => {
                self.counters.written(Tier::Shared, len);
                self.mine().insert(b.hash, len);
            }
            Some(None) => {} // another instance stored it first
        }
        self.index().insert(b.hash, len);
        self.trim();
    }

    /// Deletes what this instance wrote beyond its capacity, oldest first.
    fn trim(&self) {
        let victims: Vec<BlockHash> = self.mine().trim_to(self.capacity);
        if victims.is_empty() {
            return;
        }
        {
            let mut idx = self.index();
            for v in &victims {
                idx.remove(*v);
            }
        }
        let keys: Vec<String> = victims.iter().map(|v| self.key(*v)).collect();
        let _ = self.with_con("trim", |c| redis::cmd("DEL").arg(&keys).query::<u64>(c));
    }

    /// Lists the store's keys of this compatibility key into the index (a bounded number:
    /// as many blocks as the capacity holds). A scan that saw every key also drops from the
    /// index what the store no longer has (evicted by the server, deleted, a restart).
    fn refresh(&self) {
        let record = super::disk::record_len(&self.shape).max(1);
        let most = (self.capacity / record).max(1) as usize;
        let pattern = format!("{}*", self.prefix);
        let mut cursor: u64 = 0;
        let mut found = Vec::new();
        let complete = loop {
            let step = self.with_con("refresh", |c| {
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .query::<(u64, Vec<String>)>(c)
            });
            let Some((next, keys)) = step else { return };
            found.extend(
                keys.iter()
                    .filter_map(|k| k.strip_prefix(&self.prefix))
                    .filter_map(|h| u64::from_str_radix(h, 16).ok()),
            );
            if next == 0 {
                break true;
            }
            if found.len() >= most {
                break false;
            }
            cursor = next;
        };
        let record = super::disk::record_len(&self.shape);
        let mut idx = self.index();
        if complete {
            let present: std::collections::HashSet<BlockHash> = found.iter().copied().collect();
            let gone: Vec<BlockHash> = idx
                .files
                .keys()
                .filter(|h| !present.contains(h))
                .copied()
                .collect();
            for h in gone {
                idx.remove(h);
            }
        }
        for h in found.into_iter().take(most) {
            if !idx.files.contains_key(&h) {
                idx.insert(h, record);
            }
        }
    }
}

/// The Redis shared store (see the module docs).
pub struct RedisTier {
    inner: Arc<Inner>,
    writer: WriteQueue,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

impl RedisTier {
    /// Checks `url` (`redis://host:port/db` or `redis+unix:///path`), starts the store thread
    /// and lists the store's keys once. A store that is down at start is not an error: the
    /// instance serves, and the store is used once it answers.
    ///
    /// # Errors
    /// [`TierError::Malformed`] for a URL the client refuses, [`TierError::Io`] when the
    /// thread cannot start.
    pub fn open(url: &str, capacity: u64, shape: TierShape) -> Result<Self, TierError> {
        let client = redis::Client::open(url)
            .map_err(|e| TierError::Malformed(format!("kv_tiers.shared_url `{url}`: {e}")))?;
        let inner = Arc::new(Inner {
            client,
            prefix: format!("pdserve:kv:{:016x}:", shape.compat_hash()),
            shape,
            capacity,
            index: Mutex::new(Index::logged()),
            mine: Mutex::new(Index::default()),
            counters: TierCounters::default(),
            down_until: Mutex::new(None),
            reported_down: AtomicBool::new(false),
            outages: std::sync::atomic::AtomicU64::new(0),
            reads: Mutex::new(Vec::new()),
        });
        inner.refresh();
        let s = inner.clone();
        let writer = WriteQueue::spawn("pdserve-kv-redis", WRITE_QUEUE, move |rx| {
            store_thread(&s, &rx)
        })?;
        Ok(Self { inner, writer })
    }

    /// Whether the index lists `h` and the store is up (never asks the network).
    pub fn contains(&self, h: BlockHash) -> bool {
        !self.inner.is_down() && self.inner.index().files.contains_key(&h)
    }

    /// The key of block `h` (tests).
    pub fn key_of(&self, h: BlockHash) -> String {
        self.inner.key(h)
    }

    pub(super) fn counters(&self) -> &TierCounters {
        &self.inner.counters
    }

    /// Queues `b` for writing; a full queue or a down store drops it (counted).
    pub(super) fn write(&self, b: Arc<TierBlock>) {
        let queued = !self.inner.is_down() && self.writer.try_write(b);
        if !queued {
            self.inner
                .counters
                .dropped_writes
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Reads and verifies block `h`. Blocking (one round trip, at most [`TIMEOUT`]). At most
    /// one byte more than a block record is fetched (`GETRANGE`), so a longer value under
    /// the key is refused without being transferred or decoded.
    ///
    /// # Errors
    /// [`TierError::Missing`] when the store lost the key (or holds an empty value),
    /// [`TierError::Io`] when the store is down, [`TierError::Malformed`] for a value longer
    /// than a block record, and what [`decode`] finds.
    pub fn read(&self, h: BlockHash) -> Result<TierBlock, TierError> {
        let key = self.inner.key(h);
        let record = super::disk::max_file_len(&self.inner.shape);
        let got = self
            .inner
            .with_con("read", |c| {
                redis::cmd("GETRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(record)
                    .query::<Vec<u8>>(c)
            })
            .ok_or_else(|| {
                TierError::Io(std::io::Error::other("the shared store is unreachable"))
            })?;
        // GETRANGE answers an empty string for a missing key.
        let bytes = Some(got)
            .filter(|b| !b.is_empty())
            .ok_or(TierError::Missing)?;
        if bytes.len() as u64 > record {
            return Err(TierError::Malformed(format!(
                "a value longer than a block record ({record} bytes)"
            )));
        }
        let b = decode(&self.inner.shape, &bytes)?;
        if b.hash != h {
            return Err(TierError::Key);
        }
        self.inner.index().touch(h);
        Ok(b)
    }

    /// The keys its index gained and lost since the last call (see
    /// [`crate::kv_events::KvEventLog::drain`]).
    pub(super) fn kv_events(&self, snapshot: bool) -> crate::kv_events::KvEventBatch {
        self.inner.index().kv_events(snapshot).unwrap_or_default()
    }

    /// Forgets block `h` and deletes its key (it failed verification, or is gone).
    pub(super) fn discard(&self, h: BlockHash) {
        if self.inner.index().remove(h) {
            self.inner
                .counters
                .discarded
                .fetch_add(1, Ordering::Relaxed);
        }
        self.inner.mine().remove(h);
        let key = self.inner.key(h);
        let _ = self
            .inner
            .with_con("discard", |c| redis::cmd("DEL").arg(&key).query::<u64>(c));
    }

    /// Its figures: the blocks and bytes it knows of, its capacity.
    pub fn figures(&self) -> TierFigures {
        let (blocks, bytes) = {
            let idx = self.inner.index();
            (idx.files.len() as u64, idx.used)
        };
        self.inner
            .counters
            .figures(blocks, bytes, self.inner.capacity)
    }

    /// Whether the store is marked down (within [`DOWN_PAUSE`] of a failed command).
    pub fn is_down(&self) -> bool {
        self.inner.is_down()
    }

    /// Times the store was found down (a failure after a success, or at start).
    pub fn outages(&self) -> u64 {
        self.inner.outages.load(Ordering::Relaxed)
    }

    /// Waits (at most `timeout`) until every write queued before this call has been done and
    /// the index refreshed once more; `false` on a timeout. Blocking: tests and a clean stop.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.writer.flush(timeout)
    }
}

fn store_thread(s: &Inner, rx: &Receiver<Job>) {
    let mut next_refresh = Instant::now() + REFRESH;
    loop {
        let wait = next_refresh.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Job::Write(b)) => s.store(&b),
            Ok(Job::Flush(done)) => {
                s.refresh();
                let _ = done.try_send(());
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if Instant::now() >= next_refresh {
            s.refresh();
            next_refresh = Instant::now() + REFRESH;
        }
    }
}
