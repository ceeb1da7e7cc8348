//! The KV block pool of one instance: allocation, reference counts, the free list, a
//! watermark kept free for running sequences, and the prefix cache.
//!
//! Every allocation is a [`BlockAllocation`] guard that returns its blocks when dropped, so a
//! request that ends by any path — finished, aborted, failed, its owner crashed — cannot leak
//! blocks. Blocks can be shared ([`BlockAllocation::share`]): a block returns to the pool when
//! its last holder drops it.
//!
//! # Prefix cache
//!
//! A full block whose KV is computed (or has landed from a prefill instance) can be
//! *registered* under its [`BlockHash`] ([`crate::prefix`]): a hash chained over the parent
//! block's hash, the block's token ids and the instance's compatibility salt (model, KV
//! dtype, layout, block size), so instances with different KV layouts never match. A registered block whose last
//! holder drops it is not freed but kept as *cached*: evictable, in LRU order. A new request
//! takes the longest run of its leading blocks that are cached ([`BlockManager::take_prefix`])
//! by reference: the block's reference count goes up, and a block with holders is never
//! evicted. Allocation takes never-registered free blocks first, then evicts the least
//! recently used cached block (its hash is forgotten before it is reused).
//!
//! Only blocks that nobody writes any more are registered (the caller registers a block once
//! its KV is final: computed by a finished step, or landed and fenced by a finished transfer),
//! so a block being written is never handed to another request. Each cache entry keeps the
//! block's token ids and a hit is checked against them, so a hash collision cannot serve the
//! wrong KV.
//!
//! "Available" blocks ([`BlockManager::num_free`]) are the free ones plus the cached ones
//! nobody holds: after every request ended, `num_free() == total()` proves nothing leaked;
//! [`BlockManager::num_in_use`] counts blocks with holders.

use crate::kv_events::{KvEventBatch, KvEventLog};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

pub use crate::prefix::{block_hashes, cache_salt, extend_hashes, BlockHash};

#[derive(Debug)]
struct Entry {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    /// LRU stamp while evictable (no holder).
    stamp: Option<u64>,
    /// Prefix-cache hits on this block (the KV tiers' `selective` write policy).
    hits: u32,
}

/// A registered block the pool evicted, as the KV tiers need it (see
/// [`BlockManager::spill_evictions`]): its id (its KV is still in place until the next write)
/// and its cache key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// The block id.
    pub block: u32,
    /// Its chained hash.
    pub hash: BlockHash,
    /// Its parent's hash.
    pub parent: Option<BlockHash>,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// Prefix-cache hits it had.
    pub hits: u32,
}

#[derive(Debug)]
struct Pool {
    /// Never-registered (or forgotten) blocks nobody holds.
    free: Vec<u32>,
    refs: Vec<u32>,
    /// Registered blocks: their cache entry.
    entries: Vec<Option<Entry>>,
    /// Hash → the block registered under it.
    by_hash: HashMap<BlockHash, u32>,
    /// Cached blocks nobody holds, oldest first: LRU stamp → block.
    lru: BTreeMap<u64, u32>,
    clock: u64,
    /// Blocks taken from the cache by reference (hits), counted in blocks.
    hit_blocks: u64,
    /// Evictions of cached blocks.
    evictions: u64,
    /// Registered/forgotten hashes since the last drain (told to the proxy).
    events: KvEventLog,
    /// Whether evictions are recorded in `evicted` (KV tiers on).
    spill: bool,
    /// Evicted registered blocks since the last [`BlockManager::take_evicted`].
    evicted: Vec<Evicted>,
}

impl Pool {
    fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// One block for a new holder: a free one, else the least recently used cached one
    /// (forgotten first).
    fn take_one(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                if self.spill {
                    if let Some(e) = self.entries[b as usize].as_ref() {
                        let ev = Evicted {
                            block: b,
                            hash: e.hash,
                            parent: e.parent,
                            tokens: e.tokens.clone(),
                            hits: e.hits,
                        };
                        self.evicted.push(ev);
                    }
                }
                self.forget(b);
                self.evictions += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Removes `b`'s cache entry (it stays wherever it is held).
    fn forget(&mut self, b: u32) {
        if let Some(e) = self.entries[b as usize].take() {
            if self.by_hash.get(&e.hash) == Some(&b) {
                self.by_hash.remove(&e.hash);
                self.events.removed(e.hash);
            }
            if let Some(s) = e.stamp {
                self.lru.remove(&s);
            }
        }
    }

    fn hold(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r += 1;
        if *r == 1 {
            if let Some(s) = self.entries[b as usize]
                .as_mut()
                .and_then(|e| e.stamp.take())
            {
                self.lru.remove(&s);
            }
        }
    }

    fn unhold(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r = r.saturating_sub(1);
        if *r > 0 {
            return;
        }
        match self.entries[b as usize].as_mut() {
            Some(e) => {
                self.clock += 1;
                e.stamp = Some(self.clock);
                self.lru.insert(self.clock, b);
            }
            None => self.free.push(b),
        }
    }
}

/// A pool of KV block ids `0..total`.
#[derive(Debug, Clone)]
pub struct BlockManager {
    pool: Arc<Mutex<Pool>>,
    total: usize,
    watermark: usize,
    caching: bool,
}

/// Blocks held by one owner; freed on drop.
#[derive(Debug)]
pub struct BlockAllocation {
    blocks: Vec<u32>,
    pool: Arc<Mutex<Pool>>,
}

/// Prefix-cache figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheFigures {
    /// Cached blocks nobody holds (evictable).
    pub cached_blocks: usize,
    /// Registered blocks (held or not).
    pub registered_blocks: usize,
    /// Blocks taken from the cache by reference so far.
    pub hit_blocks: u64,
    /// Cached blocks evicted so far.
    pub evictions: u64,
}

fn lock(pool: &Mutex<Pool>) -> std::sync::MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

impl BlockManager {
    /// A pool of `total` blocks of which `watermark` are kept back from new admissions, with
    /// the prefix cache on.
    pub fn new(total: usize, watermark: usize) -> Self {
        Self::with_cache(total, watermark, true)
    }

    /// A pool of `total` blocks; `caching` turns the prefix cache on or off (off: nothing is
    /// ever registered, every lookup misses).
    pub fn with_cache(total: usize, watermark: usize, caching: bool) -> Self {
        let pool = Pool {
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
            entries: (0..total).map(|_| None).collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            hit_blocks: 0,
            evictions: 0,
            events: KvEventLog::default(),
            spill: false,
            evicted: Vec::new(),
        };
        Self {
            pool: Arc::new(Mutex::new(pool)),
            total,
            watermark: watermark.min(total),
            caching,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        lock(&self.pool)
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Whether the prefix cache is on.
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks available to new holders: free plus cached-evictable.
    pub fn num_free(&self) -> usize {
        self.lock().available()
    }

    /// Blocks with at least one holder (`total - num_free`).
    pub fn num_in_use(&self) -> usize {
        self.total - self.num_free()
    }

    /// Prefix-cache figures.
    pub fn cache_figures(&self) -> CacheFigures {
        let p = self.lock();
        CacheFigures {
            cached_blocks: p.lru.len(),
            registered_blocks: p.by_hash.len(),
            hit_blocks: p.hit_blocks,
            evictions: p.evictions,
        }
    }

    /// Whether a new sequence needing `n` blocks may be admitted (keeps the watermark free).
    pub fn can_admit(&self, n: usize) -> bool {
        self.num_free() >= n + self.watermark
    }

    /// An empty allocation to grow with [`BlockManager::grow`].
    pub fn empty(&self) -> BlockAllocation {
        BlockAllocation {
            blocks: Vec::new(),
            pool: self.pool.clone(),
        }
    }

    /// Appends `n` blocks to `alloc` (free ones first, then evicting the least recently used
    /// cached ones); takes nothing and returns `false` when fewer are available.
    pub fn grow(&self, alloc: &mut BlockAllocation, n: usize) -> bool {
        let mut pool = self.lock();
        if pool.available() < n {
            return false;
        }
        for _ in 0..n {
            let b = pool.take_one().expect("checked above");
            alloc.blocks.push(b);
        }
        true
    }

    /// How many leading blocks of `hashes` (with the token ids of `tokens`, block by block)
    /// are cached, without taking them.
    pub fn lookup(&self, hashes: &[BlockHash], tokens: &[u32], block_size: usize) -> usize {
        if !self.caching {
            return 0;
        }
        let pool = self.lock();
        Self::matching(&pool, hashes, tokens, block_size).len()
    }

    fn matching(pool: &Pool, hashes: &[BlockHash], tokens: &[u32], bs: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(&b) = pool.by_hash.get(h) else {
                break;
            };
            let e = pool.entries[b as usize]
                .as_ref()
                .expect("indexed blocks have entries");
            let want = tokens.get(i * bs..(i + 1) * bs);
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            if want != Some(&e.tokens[..]) || e.parent != parent {
                break; // a hash collision: not this prefix
            }
            out.push(b);
        }
        out
    }

    /// Appends to the empty `alloc` the longest run of cached blocks matching the leading
    /// `hashes` (and `tokens`), by reference; returns how many. They are never evicted while
    /// `alloc` (or a share of it) holds them.
    pub fn take_prefix(
        &self,
        alloc: &mut BlockAllocation,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
    ) -> usize {
        debug_assert!(alloc.blocks.is_empty(), "a prefix starts an allocation");
        if !self.caching {
            return 0;
        }
        let mut pool = self.lock();
        let hit = Self::matching(&pool, hashes, tokens, block_size);
        for &b in &hit {
            pool.hold(b);
            if let Some(e) = pool.entries[b as usize].as_mut() {
                e.hits = e.hits.saturating_add(1);
            }
        }
        pool.hit_blocks += hit.len() as u64;
        alloc.blocks.extend_from_slice(&hit);
        hit.len()
    }

    /// Registers the blocks of `alloc` at indices `from..hashes.len()` (full, final KV) under
    /// their hashes. A hash already registered to another block keeps that block (this one
    /// is freed normally when dropped). Returns how many were registered.
    pub fn register(
        &self,
        alloc: &BlockAllocation,
        from: usize,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
    ) -> usize {
        self.register_hits(alloc, from, hashes, tokens, block_size, &[])
    }

    /// As [`BlockManager::register`], block `from + j` with `hits[j]` prefix-cache hits (0
    /// past the end of `hits`): blocks whose KV was restored from a KV tier keep the count
    /// the tiers' `selective` write policy reads.
    pub fn register_hits(
        &self,
        alloc: &BlockAllocation,
        from: usize,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        hits: &[u32],
    ) -> usize {
        let (Some(blocks), Some(run), Some(run_tokens)) = (
            alloc.blocks.get(from..),
            hashes.get(from..),
            tokens.get(from * block_size..),
        ) else {
            return 0;
        };
        let parent = from.checked_sub(1).and_then(|p| hashes.get(p).copied());
        self.register_blocks(blocks, parent, run, run_tokens, block_size, hits)
    }

    /// Records every registered block the pool evicts from now on (`on`), for
    /// [`BlockManager::take_evicted`]: the KV tiers copy them out before they are rewritten.
    pub fn spill_evictions(&self, on: bool) {
        let mut pool = self.lock();
        pool.spill = on;
        pool.evicted.clear();
    }

    /// The registered blocks evicted since the last call (their KV is intact until the first
    /// write after the eviction).
    pub fn take_evicted(&self) -> Vec<Evicted> {
        std::mem::take(&mut self.lock().evicted)
    }

    /// Holds the cached leading blocks of `hashes` (as [`BlockManager::take_prefix`], but not
    /// counted as hits), so nothing evicts them while a restore of the following blocks runs.
    pub fn pin_prefix(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
    ) -> BlockAllocation {
        let mut alloc = self.empty();
        if !self.caching {
            return alloc;
        }
        let mut pool = self.lock();
        let hit = Self::matching(&pool, hashes, tokens, block_size);
        for &b in &hit {
            pool.hold(b);
        }
        alloc.blocks.extend_from_slice(&hit);
        alloc
    }

    /// Registers the blocks of `alloc` (block `j` holds `hashes[j]`, the token ids
    /// `tokens[j*bs..(j+1)*bs]`; the first block's parent is `parent`), whose KV was restored
    /// from a KV tier, each with `hits[j]` hits. A hash already registered keeps its block.
    /// Returns how many were registered.
    pub fn register_run(
        &self,
        alloc: &BlockAllocation,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        hits: &[u32],
    ) -> usize {
        self.register_blocks(&alloc.blocks, parent, hashes, tokens, block_size, hits)
    }

    /// The one registration loop: block `blocks[j]` under `hashes[j]` with the token ids
    /// `tokens[j*bs..(j+1)*bs]` and `hits[j]` hits (0 past its end), the first one's parent
    /// `parent`, each next one's the hash before it. A hash already registered keeps its
    /// block; a block already registered keeps its hash.
    fn register_blocks(
        &self,
        blocks: &[u32],
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        tokens: &[u32],
        block_size: usize,
        hits: &[u32],
    ) -> usize {
        if !self.caching {
            return 0;
        }
        let mut pool = self.lock();
        let mut n = 0;
        let mut parent = parent;
        for (j, (&b, &h)) in blocks.iter().zip(hashes).enumerate() {
            let Some(t) = tokens.get(j * block_size..(j + 1) * block_size) else {
                break;
            };
            if pool.entries[b as usize].is_none() && !pool.by_hash.contains_key(&h) {
                pool.entries[b as usize] = Some(Entry {
                    hash: h,
                    parent,
                    tokens: t.to_vec(),
                    stamp: None,
                    hits: hits.get(j).copied().unwrap_or(0),
                });
                pool.by_hash.insert(h, b);
                pool.events.stored(h);
                n += 1;
            }
            parent = Some(h);
        }
        n
    }

    /// Forgets every cache entry (the KV memory behind them is gone, e.g. a worker restarted
    /// with a fresh cache). Held blocks stay held and are freed normally.
    pub fn clear_cache(&self) {
        let mut pool = self.lock();
        pool.evicted.clear();
        let cached: Vec<u32> = pool.lru.values().copied().collect();
        for b in 0..self.total as u32 {
            pool.forget(b);
        }
        pool.free.extend(cached);
        pool.events.lost();
    }

    /// The prefix-cache events since the last call (see [`crate::kv_events`]): a snapshot of
    /// every registered hash when `snapshot` asks for one or events were lost, else the
    /// stored/removed hashes in order.
    pub fn kv_events(&self, snapshot: bool) -> KvEventBatch {
        let mut pool = self.lock();
        let pool = &mut *pool;
        let by_hash = &pool.by_hash;
        pool.events
            .drain(snapshot, || by_hash.keys().copied().collect())
    }
}

impl BlockAllocation {
    /// Moves `other`'s blocks to the end of this allocation (both of one pool).
    ///
    /// # Panics
    /// When `other` belongs to another pool.
    pub fn append(&mut self, mut other: BlockAllocation) {
        assert!(
            Arc::ptr_eq(&self.pool, &other.pool),
            "blocks of another pool"
        );
        self.blocks.append(&mut other.blocks);
    }

    /// The block ids, in sequence order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// A second holder of the same blocks (reference counts go up).
    pub fn share(&self) -> BlockAllocation {
        let mut pool = lock(&self.pool);
        for &b in &self.blocks {
            pool.hold(b);
        }
        BlockAllocation {
            blocks: self.blocks.clone(),
            pool: self.pool.clone(),
        }
    }

    /// Returns every block now (the allocation stays usable, empty). Registered blocks stay
    /// cached until their space is needed.
    pub fn release(&mut self) {
        let mut pool = lock(&self.pool);
        for b in self.blocks.drain(..).rev() {
            pool.unhold(b);
        }
    }
}

impl Drop for BlockAllocation {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_return_on_drop_and_respect_sharing() {
        let bm = BlockManager::new(8, 1);
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 3));
        assert_eq!(a.blocks(), &[0, 1, 2]);
        assert_eq!(bm.num_free(), 5);
        let shared = a.share();
        drop(a);
        assert_eq!(bm.num_free(), 5, "shared blocks stay taken");
        drop(shared);
        assert_eq!(bm.num_free(), 8);
    }

    #[test]
    fn grow_is_all_or_nothing_and_admission_keeps_the_watermark() {
        let bm = BlockManager::new(4, 1);
        let mut a = bm.empty();
        assert!(bm.can_admit(3));
        assert!(!bm.can_admit(4));
        assert!(!bm.grow(&mut a, 5));
        assert!(a.is_empty());
        assert!(bm.grow(&mut a, 4));
        assert_eq!(bm.num_free(), 0);
        a.release();
        assert_eq!(bm.num_free(), 4);
    }

    const BS: usize = 4;

    fn toks(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn freed_registered_blocks_stay_cached_and_are_taken_by_reference() {
        let bm = BlockManager::new(8, 0);
        let t = toks(12, 1);
        let h = block_hashes(1, &t, BS);
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 3));
        assert_eq!(bm.register(&a, 0, &h, &t, BS), 3);
        let ids = a.blocks().to_vec();
        drop(a);
        assert_eq!(bm.num_free(), 8, "cached blocks count as available");
        assert_eq!(bm.num_in_use(), 0);
        assert_eq!(bm.cache_figures().cached_blocks, 3);
        // A prompt sharing the first two blocks, then diverging, hits two.
        let mut t2 = t.clone();
        t2[9] = 5;
        let h2 = block_hashes(1, &t2, BS);
        assert_eq!(bm.lookup(&h2, &t2, BS), 2);
        let mut b = bm.empty();
        assert_eq!(bm.take_prefix(&mut b, &h2, &t2, BS), 2);
        assert_eq!(b.blocks(), &ids[..2]);
        assert_eq!(bm.num_in_use(), 2);
        let c = b.share();
        drop(b);
        assert_eq!(bm.num_in_use(), 2, "still shared");
        drop(c);
        assert_eq!(bm.num_in_use(), 0);
        assert_eq!(bm.cache_figures().hit_blocks, 2);
    }

    #[test]
    fn held_cached_blocks_are_never_evicted_and_lru_goes_first() {
        let bm = BlockManager::new(4, 0);
        let (t1, t2) = (toks(8, 1), toks(4, 2));
        let (h1, h2) = (block_hashes(0, &t1, BS), block_hashes(0, &t2, BS));
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 2));
        bm.register(&a, 0, &h1, &t1, BS);
        let mut b = bm.empty();
        assert!(bm.grow(&mut b, 1));
        bm.register(&b, 0, &h2, &t2, BS);
        drop(b); // cached first: oldest
        drop(a);
        // Someone holds t1's prefix: those blocks must survive any pressure.
        let mut holder = bm.empty();
        assert_eq!(bm.take_prefix(&mut holder, &h1, &t1, BS), 2);
        let mut big = bm.empty();
        assert!(!bm.grow(&mut big, 3), "only 2 are available");
        assert!(bm.grow(&mut big, 2));
        assert!(big.blocks().iter().all(|b| !holder.blocks().contains(b)));
        assert_eq!(
            bm.lookup(&h2, &t2, BS),
            0,
            "the unheld cached block was evicted"
        );
        assert_eq!(
            bm.lookup(&h1, &t1, BS),
            2,
            "the held prefix is still cached"
        );
        assert_eq!(bm.cache_figures().evictions, 1);
        drop(big);
        drop(holder);
        assert_eq!(bm.num_free(), 4);
    }

    #[test]
    fn kv_events_follow_registrations_and_evictions() {
        use crate::kv_events::KvOp;
        let bm = BlockManager::new(2, 0);
        assert_eq!(
            bm.kv_events(false).snapshot,
            Some(vec![]),
            "a new pool resyncs"
        );
        let (t1, t2) = (toks(8, 1), toks(4, 2));
        let (h1, h2) = (block_hashes(0, &t1, BS), block_hashes(0, &t2, BS));
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 2));
        bm.register(&a, 0, &h1, &t1, BS);
        drop(a);
        let b = bm.kv_events(false);
        assert_eq!(b.ops, vec![KvOp::Stored(h1.clone())]);
        // Pressure evicts the LRU block; the new registration follows its removal.
        let mut c = bm.empty();
        assert!(bm.grow(&mut c, 1));
        bm.register(&c, 0, &h2, &t2, BS);
        let b = bm.kv_events(false);
        assert_eq!(b.ops.len(), 2, "{b:?}");
        assert!(matches!(&b.ops[0], KvOp::Removed(v) if v.len() == 1));
        assert_eq!(b.ops[1], KvOp::Stored(h2.clone()));
        let mut all = bm.kv_events(true).snapshot.unwrap();
        all.sort_unstable();
        let mut want = vec![
            h2[0],
            if matches!(&b.ops[0], KvOp::Removed(v) if v[0] == h1[0]) {
                h1[1]
            } else {
                h1[0]
            },
        ];
        want.sort_unstable();
        assert_eq!(all, want, "a snapshot is what is registered now");
        bm.clear_cache();
        assert_eq!(
            bm.kv_events(false).snapshot,
            Some(vec![]),
            "a cleared cache resyncs"
        );
        drop(c);
    }

    #[test]
    fn collisions_and_duplicates_never_serve_wrong_blocks() {
        let bm = BlockManager::new(8, 0);
        let t = toks(4, 1);
        let h = block_hashes(0, &t, BS);
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 1));
        bm.register(&a, 0, &h, &t, BS);
        // Same hash, different tokens (a forced collision): a miss.
        assert_eq!(bm.lookup(&h, &toks(4, 2), BS), 0);
        // A second block computed for the same prefix is not registered twice.
        let mut b = bm.empty();
        assert!(bm.grow(&mut b, 1));
        assert_eq!(bm.register(&b, 0, &h, &t, BS), 0);
        drop(b);
        assert_eq!(bm.cache_figures().registered_blocks, 1);
        bm.clear_cache();
        assert_eq!(bm.lookup(&h, &t, BS), 0, "a lost cache forgets everything");
        drop(a);
        assert_eq!(bm.num_free(), 8);
        assert_eq!(bm.cache_figures().cached_blocks, 0);
    }

    #[test]
    fn evictions_are_recorded_for_the_tiers_and_restored_runs_chain() {
        let bm = BlockManager::new(2, 0);
        bm.spill_evictions(true);
        let t = toks(8, 1);
        let h = block_hashes(0, &t, BS);
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 2));
        bm.register(&a, 0, &h, &t, BS);
        drop(a);
        let mut hit = bm.empty();
        assert_eq!(bm.take_prefix(&mut hit, &h, &t, BS), 2);
        drop(hit);
        let mut c = bm.empty();
        assert!(bm.grow(&mut c, 2), "both cached blocks are evicted");
        let ev = bm.take_evicted();
        assert_eq!(ev.len(), 2);
        assert!(ev.iter().all(|e| e.hits == 1));
        let first = ev.iter().find(|e| e.hash == h[0]).unwrap();
        assert_eq!((first.parent, &first.tokens[..]), (None, &t[..BS]));
        assert!(bm.take_evicted().is_empty(), "drained");
        // Restored into other blocks, the second block alone: it chains to its parent.
        drop(c);
        let mut r = bm.empty();
        assert!(bm.grow(&mut r, 1));
        assert_eq!(
            bm.register_run(&r, Some(h[0]), &h[1..], &t[BS..], BS, &[3]),
            1
        );
        assert_eq!(bm.lookup(&h, &t, BS), 0, "the first block is gone");
        let mut r0 = bm.empty();
        assert!(bm.grow(&mut r0, 1));
        assert_eq!(bm.register_run(&r0, None, &h[..1], &t[..BS], BS, &[0]), 1);
        assert_eq!(bm.lookup(&h, &t, BS), 2, "the run is whole again");
        let pin = bm.pin_prefix(&h, &t, BS);
        assert_eq!(pin.len(), 2);
        drop((r, r0));
        assert_eq!(bm.num_in_use(), 2, "pinned");
        drop(pin);
        assert_eq!(bm.num_free(), 2);
        assert_eq!(bm.cache_figures().hit_blocks, 2, "a pin is not a hit");
    }

    #[test]
    fn caching_off_registers_nothing() {
        let bm = BlockManager::with_cache(4, 0, false);
        let t = toks(4, 1);
        let h = block_hashes(0, &t, BS);
        let mut a = bm.empty();
        assert!(bm.grow(&mut a, 1));
        assert_eq!(bm.register(&a, 0, &h, &t, BS), 0);
        drop(a);
        assert_eq!(bm.lookup(&h, &t, BS), 0);
    }
}
