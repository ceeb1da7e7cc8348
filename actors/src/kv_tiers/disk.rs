//! The disk tier: one file per block in `<dir>/<compat hash>/`, LRU by capacity, written by
//! one named thread and read by the caller (a blocking task).
//!
//! The same code is the **shared directory store** ([`DirMode::Shared`]): a directory that
//! several instances read and write (one host's instances, or a shared filesystem mounted on
//! every host). Then the index is a cache of what this instance knows, not the truth: the
//! writer thread lists the directory every [`RESCAN`] (and on a flush), so a block another
//! instance wrote is found while lookups never touch the filesystem;
//! a write whose file exists already is skipped; temporary names carry the process id and a
//! counter, so two writers never write one temporary file; at open only temporary files older
//! than [`STALE_TMP`] are removed (younger ones may be another instance's write in progress).
//! Each instance trims the directory to its own capacity, LRU among the files it knows.
//!
//! # File format (little endian)
//!
//! ```text
//! magic "PDKVBLK1" | compat hash u64 | compat key len u32 | compat key | block hash u64 |
//! has parent u8 | parent u64 | hits u32 | tokens u32 | token ids u32 × tokens |
//! payload len u64 | payload | XXH3-64 of every byte before it u64
//! ```
//!
//! Every length is checked against the instance's shape before anything is allocated: the
//! compat key is at most [`MAX_COMPAT_LEN`] bytes, the token count must be the block size, the
//! payload length must be one block's bytes, and a file longer than that whole record is
//! refused unread. A file is written under a temporary name and renamed, so a reader sees a
//! whole file or none.

use super::queue::{Job, WriteQueue};
use super::{Tier, TierBlock, TierCounters, TierError, TierFigures, TierShape};
use crate::block_manager::BlockHash;
use crate::kv_events::{KvEventBatch, KvEventLog};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};

const MAGIC: &[u8; 8] = b"PDKVBLK1";
/// Longest compatibility key a file may carry.
pub const MAX_COMPAT_LEN: usize = 4096;
/// Writes queued for the disk thread at most; past that a write is dropped (counted).
const WRITE_QUEUE: usize = 256;
const SUFFIX: &str = "kvb";
/// How often a shared directory is listed for other instances' blocks.
pub const RESCAN: std::time::Duration = std::time::Duration::from_millis(500);
/// In a shared directory, a temporary file older than this is a write cut off by a stop.
pub const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(600);

/// Whether this instance alone writes the directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirMode {
    /// This instance's own disk tier: its index is the truth.
    Local,
    /// A directory other instances write too (see the module docs).
    Shared,
}

impl DirMode {
    fn tier(self) -> Tier {
        match self {
            DirMode::Local => Tier::Disk,
            DirMode::Shared => Tier::Shared,
        }
    }
}

/// Encodes `b` as a block file.
pub(super) fn encode(shape: &TierShape, b: &TierBlock) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.bytes.len() + 4 * b.tokens.len() + shape.compat.len() + 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&shape.compat_hash().to_le_bytes());
    out.extend_from_slice(&(shape.compat.len() as u32).to_le_bytes());
    out.extend_from_slice(shape.compat.as_bytes());
    out.extend_from_slice(&b.hash.to_le_bytes());
    out.push(u8::from(b.parent.is_some()));
    out.extend_from_slice(&b.parent.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&b.hits.to_le_bytes());
    out.extend_from_slice(&(b.tokens.len() as u32).to_le_bytes());
    for t in &b.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(b.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&b.bytes);
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The length of a block record of `shape` (its compatibility key included).
pub(super) fn record_len(shape: &TierShape) -> u64 {
    max_file_len(shape) - MAX_COMPAT_LEN as u64 + shape.compat.len() as u64
}

/// The longest file a block of `shape` can be.
pub(super) fn max_file_len(shape: &TierShape) -> u64 {
    (8 + 8
        + 4
        + MAX_COMPAT_LEN
        + 8
        + 1
        + 8
        + 4
        + 4
        + 4 * shape.block_size
        + 8
        + shape.payload_bytes
        + 8) as u64
}

struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TierError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(TierError::ShortRead(format!(
                "{} bytes end inside the {what}",
                self.buf.len()
            )));
        };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u64(&mut self, what: &str) -> Result<u64, TierError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    fn u32(&mut self, what: &str) -> Result<u32, TierError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
}

/// A block record's fields before its payload.
pub(super) struct Header<'a> {
    compat_hash: u64,
    compat: &'a [u8],
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    pub(super) hits: u32,
    pub(super) tokens: Vec<u32>,
}

impl Header<'_> {
    /// Whether it was stored under `shape`'s compatibility key.
    fn compatible(&self, shape: &TierShape) -> bool {
        self.compat_hash == shape.compat_hash() && self.compat == shape.compat.as_bytes()
    }
}

/// Decodes a record's header (magic through the payload length) at `c`, checking every
/// length against `shape`.
fn decode_header<'a>(shape: &TierShape, c: &mut Cursor<'a>) -> Result<Header<'a>, TierError> {
    if c.take(8, "magic")? != MAGIC {
        return Err(TierError::Malformed("not a pdserve KV block file".into()));
    }
    let compat_hash = c.u64("compat hash")?;
    let compat_len = c.u32("compat key length")? as usize;
    if compat_len > MAX_COMPAT_LEN {
        return Err(TierError::Malformed(format!(
            "compat key of {compat_len} bytes (at most {MAX_COMPAT_LEN})"
        )));
    }
    let compat = c.take(compat_len, "compat key")?;
    let hash = c.u64("block hash")?;
    let has_parent = c.take(1, "parent flag")?[0];
    let parent = c.u64("parent hash")?;
    let hits = c.u32("hit count")?;
    let ntok = c.u32("token count")? as usize;
    if ntok != shape.block_size {
        return Err(TierError::Malformed(format!(
            "{ntok} tokens in a block of {}",
            shape.block_size
        )));
    }
    let tokens = c
        .take(4 * ntok, "token ids")?
        .chunks_exact(4)
        .map(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")))
        .collect();
    let payload_len = c.u64("payload length")?;
    if payload_len != shape.payload_bytes as u64 {
        return Err(TierError::Malformed(format!(
            "payload of {payload_len} bytes (a block is {})",
            shape.payload_bytes
        )));
    }
    Ok(Header {
        compat_hash,
        compat,
        hash,
        parent: (has_parent != 0).then_some(parent),
        hits,
        tokens,
    })
}

/// Decodes and verifies a block file against `shape`.
///
/// # Errors
/// [`TierError::ShortRead`] for a truncated file, [`TierError::Malformed`] for a bad magic, a
/// length out of bounds or trailing bytes, [`TierError::Checksum`], [`TierError::Compat`].
pub(super) fn decode(shape: &TierShape, buf: &[u8]) -> Result<TierBlock, TierError> {
    let mut c = Cursor { buf, at: 0 };
    let head = decode_header(shape, &mut c)?;
    let payload = c.take(shape.payload_bytes, "payload")?;
    let body_end = c.at;
    let sum = c.u64("checksum")?;
    if c.at != buf.len() {
        return Err(TierError::Malformed(format!(
            "{} bytes after the checksum",
            buf.len() - c.at
        )));
    }
    if xxhash_rust::xxh3::xxh3_64(&buf[..body_end]) != sum {
        return Err(TierError::Checksum);
    }
    if !head.compatible(shape) {
        return Err(TierError::Compat);
    }
    Ok(TierBlock {
        hash: head.hash,
        parent: head.parent,
        tokens: head.tokens,
        hits: head.hits,
        bytes: payload.to_vec(),
    })
}

/// Stored blocks by hash, LRU by a logical clock, with their bytes summed; a logged index
/// ([`Index::logged`]) also logs the hashes it gains and loses for the proxy's KV index.
#[derive(Debug, Default)]
pub(super) struct Index {
    /// Hash → (file length, LRU stamp).
    pub(super) files: HashMap<BlockHash, (u64, u64)>,
    lru: BTreeMap<u64, BlockHash>,
    pub(super) used: u64,
    clock: u64,
    events: Option<KvEventLog>,
}

impl Index {
    /// An empty index that logs its stored/removed hashes ([`Index::kv_events`]).
    pub(super) fn logged() -> Self {
        Self {
            events: Some(KvEventLog::default()),
            ..Self::default()
        }
    }

    /// Removes `h` without logging it; its length.
    fn take(&mut self, h: BlockHash) -> Option<u64> {
        let (len, stamp) = self.files.remove(&h)?;
        self.lru.remove(&stamp);
        self.used -= len;
        Some(len)
    }

    pub(super) fn insert(&mut self, h: BlockHash, len: u64) {
        let had = self.take(h).is_some();
        self.clock += 1;
        self.files.insert(h, (len, self.clock));
        self.lru.insert(self.clock, h);
        self.used += len;
        if let (false, Some(log)) = (had, self.events.as_mut()) {
            log.stored(h);
        }
    }

    pub(super) fn remove(&mut self, h: BlockHash) -> bool {
        let had = self.take(h).is_some();
        if let (true, Some(log)) = (had, self.events.as_mut()) {
            log.removed(h);
        }
        had
    }

    /// Removes the least recently used block; its hash.
    pub(super) fn pop_oldest(&mut self) -> Option<BlockHash> {
        let (_, old) = self.lru.first_key_value()?;
        let old = *old;
        self.remove(old);
        Some(old)
    }

    /// Removes blocks, oldest first, until at most `capacity` bytes are held; their hashes.
    pub(super) fn trim_to(&mut self, capacity: u64) -> Vec<BlockHash> {
        let mut victims = Vec::new();
        while self.used > capacity {
            let Some(old) = self.pop_oldest() else { break };
            victims.push(old);
        }
        victims
    }

    /// Its events since the last call (`None`: not logged; see [`KvEventLog::drain`]).
    pub(super) fn kv_events(&mut self, snapshot: bool) -> Option<KvEventBatch> {
        let files = &self.files;
        let log = self.events.as_mut()?;
        Some(log.drain(snapshot, || files.keys().copied().collect()))
    }

    pub(super) fn touch(&mut self, h: BlockHash) {
        if let Some((len, _)) = self.files.get(&h).copied() {
            self.insert(h, len);
        }
    }
}

struct Shared {
    dir: PathBuf,
    capacity: u64,
    shape: TierShape,
    mode: DirMode,
    index: Mutex<Index>,
    counters: TierCounters,
    /// Numbers this process's temporary files.
    tmp_seq: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, h: BlockHash) -> PathBuf {
        self.dir.join(format!("{h:016x}.{SUFFIX}"))
    }

    /// In a shared directory: whether the file of `h` exists, adopting it into the index
    /// (another instance wrote it).
    fn adopt(&self, h: BlockHash) -> bool {
        if self.mode != DirMode::Shared {
            return false;
        }
        match std::fs::metadata(self.path(h)) {
            Ok(m) if m.is_file() => {
                let mut idx = self.index();
                if !idx.files.contains_key(&h) {
                    idx.insert(h, m.len());
                }
                true
            }
            _ => false,
        }
    }

    /// In a shared directory: lists its block files into the index (the writer thread, every
    /// [`RESCAN`] and on a flush), so lookups from the Scheduler never touch the filesystem;
    /// at most as many as the capacity holds. A listing that saw every file also drops from
    /// the index what another instance removed.
    fn rescan(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let most = (self.capacity / record_len(&self.shape).max(1)).max(1) as usize;
        let mut found = HashMap::new();
        let mut complete = true;
        for entry in entries.flatten() {
            if found.len() >= most {
                complete = false;
                break;
            }
            let name = entry.file_name();
            let Some(h) = name
                .to_string_lossy()
                .strip_suffix(&format!(".{SUFFIX}"))
                .and_then(|s| u64::from_str_radix(s, 16).ok())
            else {
                continue;
            };
            found.insert(h, entry.metadata().map_or(0, |m| m.len()));
        }
        let mut idx = self.index();
        if complete {
            let gone: Vec<BlockHash> = idx
                .files
                .keys()
                .filter(|h| !found.contains_key(h))
                .copied()
                .collect();
            for h in gone {
                idx.remove(h);
            }
        }
        for (h, len) in found {
            if !idx.files.contains_key(&h) {
                idx.insert(h, len);
            }
        }
    }

    /// Writes one block (the disk thread).
    fn store(&self, b: &TierBlock) -> std::io::Result<()> {
        if self.index().files.contains_key(&b.hash) {
            self.index().touch(b.hash);
            return Ok(());
        }
        if self.adopt(b.hash) {
            return Ok(()); // another instance stored it first
        }
        let bytes = encode(&self.shape, b);
        let len = bytes.len() as u64;
        if len > self.capacity {
            self.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!(".{:016x}.{}.{seq}.tmp", b.hash, std::process::id()));
        if let Err(e) = std::fs::write(&tmp, &bytes) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, self.path(b.hash))?;
        self.counters.written(self.mode.tier(), len);
        let victims = {
            let mut idx = self.index();
            idx.insert(b.hash, len);
            idx.trim_to(self.capacity)
        };
        for v in victims {
            let _ = std::fs::remove_file(self.path(v));
        }
        Ok(())
    }
}

/// The disk tier (see the module docs).
pub struct DiskTier {
    shared: Arc<Shared>,
    writer: WriteQueue,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.shared.dir)
            .finish()
    }
}

impl DiskTier {
    /// Opens `<base>/<compat hash>/`, verifies every block file there (bad ones are removed
    /// and counted as discarded), rebuilds the index (oldest modification first in LRU
    /// order, trimmed to `capacity`) and starts the writer thread. Blocking.
    ///
    /// # Errors
    /// When the directory cannot be created or listed, or the thread cannot start.
    pub fn open(base: &Path, capacity: u64, shape: TierShape) -> Result<Self, TierError> {
        Self::open_dir(base, capacity, shape, DirMode::Local)
    }

    /// [`DiskTier::open`] for a directory in `mode` (a shared one: see the module docs).
    ///
    /// # Errors
    /// As [`DiskTier::open`].
    pub fn open_dir(
        base: &Path,
        capacity: u64,
        shape: TierShape,
        mode: DirMode,
    ) -> Result<Self, TierError> {
        let dir = base.join(format!("{:016x}", shape.compat_hash()));
        std::fs::create_dir_all(&dir).map_err(TierError::Io)?;
        let shared = Arc::new(Shared {
            dir,
            capacity,
            shape,
            mode,
            index: Mutex::new(Index::logged()),
            counters: TierCounters::default(),
            tmp_seq: std::sync::atomic::AtomicU64::new(0),
        });
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&shared.dir).map_err(TierError::Io)? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp") {
                // A write cut off by a stop; in a shared directory, only an old one (a young
                // one may be another instance's write in progress).
                let stale = mode == DirMode::Local
                    || entry
                        .metadata()
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|age| age > STALE_TMP);
                if stale {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            let Some(h) = name
                .strip_suffix(&format!(".{SUFFIX}"))
                .and_then(|s| u64::from_str_radix(s, 16).ok())
            else {
                continue;
            };
            match read_verified(&shared.shape, &path).and_then(|b| {
                if b.hash == h {
                    Ok(b)
                } else {
                    Err(TierError::Key)
                }
            }) {
                Ok(_) => {
                    let meta = entry.metadata().ok();
                    let len = meta.as_ref().map_or(0, |m| m.len());
                    let mtime = meta.and_then(|m| m.modified().ok());
                    found.push((mtime, h, len));
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "KV disk tier: removing a block file that fails verification");
                    shared.counters.discarded.fetch_add(1, Ordering::Relaxed);
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        found.sort();
        {
            let mut idx = shared.index();
            for (_, h, len) in &found {
                idx.insert(*h, *len);
            }
        }
        // Over capacity (a smaller capacity than last time): the oldest go.
        let victims: Vec<BlockHash> = shared.index().trim_to(capacity);
        for v in victims {
            let _ = std::fs::remove_file(shared.path(v));
        }
        tracing::info!(dir = %shared.dir.display(), blocks = found.len(), tier = mode.tier().as_str(), "KV disk tier opened");
        let s = shared.clone();
        let thread = match mode {
            DirMode::Local => "pdserve-kv-disk",
            DirMode::Shared => "pdserve-kv-shared",
        };
        let writer = WriteQueue::spawn(thread, WRITE_QUEUE, move |rx| {
            let shared_dir = s.mode == DirMode::Shared;
            loop {
                let job = match rx.recv_timeout(RESCAN) {
                    Ok(job) => job,
                    Err(RecvTimeoutError::Timeout) => {
                        if shared_dir {
                            s.rescan();
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                match job {
                    Job::Write(b) => {
                        if let Err(e) = s.store(&b) {
                            s.counters.dropped_writes.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "KV disk tier: a block write failed");
                        }
                    }
                    Job::Flush(done) => {
                        if shared_dir {
                            s.rescan();
                        }
                        let _ = done.try_send(());
                    }
                }
            }
        })?;
        Ok(Self { shared, writer })
    }

    /// The directory its files are in.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The file of block `h` (whether or not it exists).
    pub fn file_of(&self, h: BlockHash) -> PathBuf {
        self.shared.path(h)
    }

    /// Whether the index lists `h` (never touches the filesystem: in a shared directory the
    /// writer thread lists other instances' files into it).
    pub fn contains(&self, h: BlockHash) -> bool {
        self.shared.index().files.contains_key(&h)
    }

    /// Which tier this directory is (disk or the shared store), for labels.
    pub fn tier(&self) -> Tier {
        self.shared.mode.tier()
    }

    pub(super) fn counters(&self) -> &TierCounters {
        &self.shared.counters
    }

    /// Queues `b` for writing; a full queue drops it (counted), never waits.
    pub(super) fn write(&self, b: Arc<TierBlock>, _sum: u64) {
        if !self.writer.try_write(b) {
            self.shared
                .counters
                .dropped_writes
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Queues `b` for writing, waiting while the queue is full (a stop's persistence, off the
    /// async threads); `false` when the writer is gone.
    pub(super) fn write_waiting(&self, b: Arc<TierBlock>) -> bool {
        self.writer.write_waiting(b)
    }

    /// Reads and verifies block `h` (most recently used now). Blocking.
    ///
    /// # Errors
    /// Any [`TierError`]: the caller counts it as a miss.
    pub fn read(&self, h: BlockHash) -> Result<TierBlock, TierError> {
        let b = read_verified(&self.shared.shape, &self.shared.path(h))?;
        if b.hash != h {
            return Err(TierError::Key);
        }
        self.shared.index().touch(h);
        Ok(b)
    }

    /// Opens block `h`'s file for a streamed restore: its length, header and compatibility
    /// key checked, its checksum read; the payload is left to read layer by layer (and the
    /// checksum to verify over it: [`super::stream::StreamLoad::run`]). Returns the stored
    /// parent hash and token ids (for the caller's key check) with the open file. Blocking.
    ///
    /// # Errors
    /// As [`DiskTier::read`], but for the checksum.
    pub(super) fn open_block(
        &self,
        h: BlockHash,
    ) -> Result<(Option<BlockHash>, Vec<u32>, super::stream::BlockFile), TierError> {
        use std::os::unix::fs::FileExt;
        let shape = &self.shared.shape;
        let file = std::fs::File::open(self.shared.path(h))?;
        let len = file.metadata()?.len();
        let want = record_len(shape);
        if len < want {
            return Err(TierError::ShortRead(format!("{len} of {want} bytes")));
        }
        if len > want {
            return Err(TierError::Malformed(format!(
                "{len} bytes (a block record is {want})"
            )));
        }
        let header_len = want as usize - shape.payload_bytes - 8;
        let mut header = vec![0u8; header_len];
        file.read_exact_at(&mut header, 0)?;
        let mut sum = [0u8; 8];
        file.read_exact_at(&mut sum, want - 8)?;
        let (parent, tokens, hits) = {
            let head = decode_header(
                shape,
                &mut Cursor {
                    buf: &header,
                    at: 0,
                },
            )?;
            if !head.compatible(shape) {
                return Err(TierError::Compat);
            }
            if head.hash != h {
                return Err(TierError::Key);
            }
            (head.parent, head.tokens, head.hits)
        };
        Ok((
            parent,
            tokens,
            super::stream::BlockFile {
                file,
                header,
                payload_at: header_len as u64,
                sum: u64::from_le_bytes(sum),
                hits,
            },
        ))
    }

    /// Block `h` was restored from here: most recently used now.
    pub(super) fn touched(&self, h: BlockHash) {
        self.shared.index().touch(h);
    }

    /// The hashes its index gained and lost since the last call (see
    /// [`crate::kv_events::KvEventLog::drain`]).
    pub(super) fn kv_events(&self, snapshot: bool) -> KvEventBatch {
        self.shared.index().kv_events(snapshot).unwrap_or_default()
    }

    /// Forgets block `h` and removes its file (it failed verification).
    pub(super) fn discard(&self, h: BlockHash) {
        if self.shared.index().remove(h) {
            self.shared
                .counters
                .discarded
                .fetch_add(1, Ordering::Relaxed);
        }
        let _ = std::fs::remove_file(self.shared.path(h));
    }

    /// Its figures.
    pub fn figures(&self) -> TierFigures {
        let (blocks, bytes) = {
            let idx = self.shared.index();
            (idx.files.len() as u64, idx.used)
        };
        self.shared
            .counters
            .figures(blocks, bytes, self.shared.capacity)
    }

    /// Waits (at most `timeout`) until every write queued before this call has been
    /// written; `false` on a timeout or a stopped writer. Blocking: for tests and a clean
    /// stop, off the async threads.
    pub fn flush(&self, timeout: std::time::Duration) -> bool {
        self.writer.flush(timeout)
    }
}

/// Reads `path` (refusing a file longer than a block record before reading it) and decodes it.
fn read_verified(shape: &TierShape, path: &Path) -> Result<TierBlock, TierError> {
    let max = max_file_len(shape);
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len > max {
        return Err(TierError::Malformed(format!(
            "{len} bytes (a block file is at most {max})"
        )));
    }
    let mut buf = Vec::with_capacity(len as usize);
    f.take(max).read_to_end(&mut buf)?;
    decode(shape, &buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_tiers::tests::{block, shape};

    #[test]
    fn a_block_file_verifies_and_every_damage_is_a_typed_miss() {
        let s = shape();
        let b = block(7, Some(6), 9);
        let file = encode(&s, &b);
        assert_eq!(decode(&s, &file).unwrap(), b);
        assert_eq!(file.len() as u64, record_len(&s));
        assert!(file.len() as u64 <= max_file_len(&s));
        let mut flipped = file.clone();
        let mid = file.len() - 20;
        flipped[mid] ^= 1;
        assert_eq!(decode(&s, &flipped).unwrap_err().kind(), "checksum");
        assert_eq!(
            decode(&s, &file[..file.len() - 1]).unwrap_err().kind(),
            "short_read"
        );
        assert_eq!(decode(&s, &file[..30]).unwrap_err().kind(), "short_read");
        let mut longer = file.clone();
        longer.push(0);
        assert_eq!(decode(&s, &longer).unwrap_err().kind(), "malformed");
        let mut other = s.clone();
        other.compat = "another model".into();
        assert_eq!(
            decode(&other, &encode(&s, &b)).unwrap_err().kind(),
            "compat"
        );
        let mut bigger = s.clone();
        bigger.payload_bytes = 128;
        assert_eq!(decode(&bigger, &file).unwrap_err().kind(), "malformed");
        // A huge length field is refused before anything is allocated.
        let mut huge = file.clone();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&s, &huge).unwrap_err().kind(), "malformed");
    }

    #[test]
    fn a_reopened_directory_is_warm_and_bad_files_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let t = DiskTier::open(dir.path(), 1 << 20, shape()).unwrap();
        for h in 1..=3 {
            t.write(Arc::new(block(h, None, h as u8)), 0);
        }
        assert!(t.flush(std::time::Duration::from_secs(5)));
        assert_eq!(t.figures().blocks, 3);
        assert_eq!(t.read(2).unwrap().bytes, vec![2; 64]);
        let f3 = t.file_of(3);
        drop(t);
        let bytes = std::fs::read(&f3).unwrap();
        std::fs::write(&f3, &bytes[..bytes.len() / 2]).unwrap();
        let t = DiskTier::open(dir.path(), 1 << 20, shape()).unwrap();
        assert!(t.contains(1) && t.contains(2) && !t.contains(3));
        assert_eq!(t.figures().discarded, 1);
        assert!(!f3.exists(), "the truncated file was removed");
        // Capacity bounds the files kept: LRU goes first.
        let one = encode(&shape(), &block(1, None, 1)).len() as u64;
        let small = DiskTier::open(dir.path(), 2 * one, shape()).unwrap();
        small.write(Arc::new(block(4, None, 4)), 0);
        assert!(small.flush(std::time::Duration::from_secs(5)));
        assert_eq!(small.figures().blocks, 2);
        assert!(small.contains(4));
    }
}
