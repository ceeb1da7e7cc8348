//! The host spill region: blocks in process memory, bounded by a byte budget, LRU.

use super::TierBlock;
use crate::block_manager::BlockHash;
use crate::kv_events::{KvEventBatch, KvEventLog};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A stored block: the block, its checksum when stored, its LRU stamp.
type Slot = (Arc<TierBlock>, u64, u64);

/// Blocks in memory up to `capacity` bytes; the least recently used leave first.
#[derive(Debug)]
pub(super) struct HostTier {
    capacity: u64,
    used: u64,
    blocks: HashMap<BlockHash, Slot>,
    lru: BTreeMap<u64, BlockHash>,
    clock: u64,
    /// Hashes stored and dropped, for the proxy's KV index (medium `host`).
    events: KvEventLog,
}

impl HostTier {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            events: KvEventLog::default(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn used(&self) -> u64 {
        self.used
    }

    pub(super) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(super) fn contains(&self, h: BlockHash) -> bool {
        self.blocks.contains_key(&h)
    }

    fn touch(&mut self, h: BlockHash) {
        self.clock += 1;
        if let Some(slot) = self.blocks.get_mut(&h) {
            self.lru.remove(&slot.2);
            slot.2 = self.clock;
            self.lru.insert(self.clock, h);
        }
    }

    /// Stores `b` (a block already held is only touched); returns whether it is held now and
    /// the blocks evicted to make room (with their checksums), oldest first. A block larger
    /// than the whole region is not stored and comes back as the only victim.
    pub(super) fn insert(
        &mut self,
        b: Arc<TierBlock>,
        sum: u64,
    ) -> (bool, Vec<(Arc<TierBlock>, u64)>) {
        if self.blocks.contains_key(&b.hash) {
            self.touch(b.hash);
            return (true, Vec::new());
        }
        let size = b.footprint();
        if size > self.capacity {
            return (false, vec![(b, sum)]);
        }
        let mut victims = Vec::new();
        while self.used + size > self.capacity {
            let Some((_, old)) = self.lru.pop_first() else {
                break;
            };
            if let Some((v, s, _)) = self.blocks.remove(&old) {
                self.used -= v.footprint();
                self.events.removed(old);
                victims.push((v, s));
            }
        }
        self.clock += 1;
        self.used += size;
        self.lru.insert(self.clock, b.hash);
        self.events.stored(b.hash);
        self.blocks.insert(b.hash, (b, sum, self.clock));
        (true, victims)
    }

    /// Every block held, with its stored checksum, least recently used first.
    pub(super) fn all(&self) -> Vec<(Arc<TierBlock>, u64)> {
        self.lru
            .values()
            .filter_map(|h| self.blocks.get(h).map(|(b, s, _)| (b.clone(), *s)))
            .collect()
    }

    /// The block under `h` and its stored checksum (most recently used now).
    pub(super) fn get(&mut self, h: BlockHash) -> Option<(Arc<TierBlock>, u64)> {
        self.touch(h);
        self.blocks.get(&h).map(|(b, s, _)| (b.clone(), *s))
    }

    pub(super) fn remove(&mut self, h: BlockHash) {
        if let Some((b, _, stamp)) = self.blocks.remove(&h) {
            self.lru.remove(&stamp);
            self.used -= b.footprint();
            self.events.removed(h);
        }
    }

    /// Its events since the last call (see [`KvEventLog::drain`]).
    pub(super) fn kv_events(&mut self, snapshot: bool) -> KvEventBatch {
        let blocks = &self.blocks;
        self.events
            .drain(snapshot, || blocks.keys().copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_tiers::tests::block;

    #[test]
    fn lru_by_bytes_and_a_get_refreshes() {
        let one = block(1, None, 0).footprint();
        let mut t = HostTier::new(2 * one);
        assert!(t.insert(Arc::new(block(1, None, 1)), 11).1.is_empty());
        assert!(t.insert(Arc::new(block(2, None, 2)), 22).1.is_empty());
        assert_eq!(t.get(1).unwrap().1, 11, "1 is now the most recent");
        let (stored, victims) = t.insert(Arc::new(block(3, None, 3)), 33);
        assert!(stored);
        assert_eq!(victims.len(), 1);
        assert_eq!((victims[0].0.hash, victims[0].1), (2, 22));
        assert!(t.contains(1) && t.contains(3) && !t.contains(2));
        assert_eq!(t.used(), 2 * one);
        t.remove(1);
        assert_eq!((t.len(), t.used()), (1, one));
        let mut tiny = HostTier::new(one - 1);
        let (stored, victims) = tiny.insert(Arc::new(block(4, None, 4)), 44);
        assert!(!stored && victims.len() == 1, "too large: passed on");
    }
}
