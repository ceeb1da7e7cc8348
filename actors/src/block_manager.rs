//! The KV block pool of one instance: allocation, reference counts, the free list and a
//! watermark kept free for running sequences.
//!
//! Every allocation is a [`BlockAllocation`] guard that returns its blocks when dropped, so a
//! request that ends by any path — finished, aborted, failed, its owner crashed — cannot leak
//! blocks. Blocks can be shared ([`BlockAllocation::share`]): a block returns to the free list
//! when its last holder drops it.

use std::sync::{Arc, Mutex};

#[derive(Debug)]
struct Pool {
    free: Vec<u32>,
    refs: Vec<u32>,
}

/// A pool of KV block ids `0..total`.
#[derive(Debug, Clone)]
pub struct BlockManager {
    pool: Arc<Mutex<Pool>>,
    total: usize,
    watermark: usize,
}

/// Blocks held by one owner; freed on drop.
#[derive(Debug)]
pub struct BlockAllocation {
    blocks: Vec<u32>,
    pool: Arc<Mutex<Pool>>,
}

impl BlockManager {
    /// A pool of `total` blocks of which `watermark` are kept back from new admissions.
    pub fn new(total: usize, watermark: usize) -> Self {
        let pool = Pool {
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
        };
        Self {
            pool: Arc::new(Mutex::new(pool)),
            total,
            watermark: watermark.min(total),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Free blocks.
    pub fn num_free(&self) -> usize {
        self.lock().free.len()
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

    /// Appends `n` blocks to `alloc`; takes nothing and returns `false` when fewer are free.
    pub fn grow(&self, alloc: &mut BlockAllocation, n: usize) -> bool {
        let mut pool = self.lock();
        if pool.free.len() < n {
            return false;
        }
        for _ in 0..n {
            let b = pool.free.pop().expect("checked above");
            pool.refs[b as usize] = 1;
            alloc.blocks.push(b);
        }
        true
    }
}

impl BlockAllocation {
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
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        for &b in &self.blocks {
            pool.refs[b as usize] += 1;
        }
        BlockAllocation {
            blocks: self.blocks.clone(),
            pool: self.pool.clone(),
        }
    }

    /// Returns every block now (the allocation stays usable, empty).
    pub fn release(&mut self) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        for b in self.blocks.drain(..).rev() {
            let r = &mut pool.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r == 0 {
                pool.free.push(b);
            }
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
}
