//! KV events: which prefix-cache blocks each instance holds, told to the proxy, and the
//! proxy's index of them (what the KV-aware router reads).
//!
//! An instance's [`BlockManager`](crate::block_manager::BlockManager) logs every block hash it
//! registers (*stored*) and every one it forgets (*removed*: evicted, or the cache cleared),
//! in order, in a bounded [`KvEventLog`]. Its control plane drains the log every
//! `KV_EVENTS_INTERVAL` (`pdserve_actors::control_plane`) and sends the batch to the proxy (`Opaque` topic [`TOPIC_KV_EVENTS`], JSON
//! [`KvEventBatch`]). Right after each (re)registration, and whenever the log overflowed or
//! the cache was cleared, the batch is a *snapshot*: every hash the instance holds, which
//! replaces what the proxy knew. A restarted proxy or instance therefore converges within
//! 100 ms of its registration.
//!
//! The proxy keeps a [`KvIndex`]: per instance URL, the set of hashes it holds, bounded by
//! `proxy.kv_index_max_blocks` per instance (hashes past the bound are not indexed and
//! counted as dropped; the index under-reports a very large cache, it never over-reports).
//! The overlap of a prompt with an instance is the number of its leading block hashes, chained
//! with that instance's salt and block size as given in its registration, found in that set.

use crate::prefix::{block_hashes, BlockHash};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// Control-plane topic of a [`KvEventBatch`] (instance → proxy, one-way).
pub const TOPIC_KV_EVENTS: &str = "kv_events/1";

/// Events kept between two drains before the log gives up and asks for a snapshot instead.
pub const MAX_PENDING_EVENTS: usize = 1 << 16;

/// Default bound on the hashes the proxy indexes per instance (`proxy.kv_index_max_blocks`).
pub const DEFAULT_INDEX_MAX_BLOCKS: usize = 1 << 20;

/// A run of events of one kind, in the order they happened.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KvOp {
    /// Blocks registered in the prefix cache.
    Stored(Vec<BlockHash>),
    /// Blocks forgotten (evicted, or the cache cleared).
    Removed(Vec<BlockHash>),
}

/// What one drain of an instance's log carries.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct KvEventBatch {
    /// Every hash the instance holds now: replaces the proxy's view. `None` for a delta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Vec<BlockHash>>,
    /// Events since the previous batch (after `snapshot` when both are present).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<KvOp>,
}

impl KvEventBatch {
    /// Whether it carries nothing (a delta without events).
    pub fn is_empty(&self) -> bool {
        self.snapshot.is_none() && self.ops.is_empty()
    }
}

/// An instance's bounded, ordered log of stored/removed block hashes.
#[derive(Debug)]
pub struct KvEventLog {
    ops: Vec<KvOp>,
    pending: usize,
    /// The log lost events (overflow, cache cleared, new pool): the next drain is a snapshot.
    resync: bool,
}

impl Default for KvEventLog {
    /// A new log starts with a snapshot (whatever the proxy knew of an earlier pool is stale).
    fn default() -> Self {
        Self {
            ops: Vec::new(),
            pending: 0,
            resync: true,
        }
    }
}

impl KvEventLog {
    fn push(&mut self, stored: bool, hash: BlockHash) {
        if self.resync {
            return; // the next drain sends everything anyway
        }
        if self.pending >= MAX_PENDING_EVENTS {
            self.lost();
            return;
        }
        self.pending += 1;
        match (self.ops.last_mut(), stored) {
            (Some(KvOp::Stored(v)), true) | (Some(KvOp::Removed(v)), false) => v.push(hash),
            (_, true) => self.ops.push(KvOp::Stored(vec![hash])),
            (_, false) => self.ops.push(KvOp::Removed(vec![hash])),
        }
    }

    /// A block was registered under `hash`.
    pub fn stored(&mut self, hash: BlockHash) {
        self.push(true, hash);
    }

    /// The block registered under `hash` was forgotten.
    pub fn removed(&mut self, hash: BlockHash) {
        self.push(false, hash);
    }

    /// Events were lost: drop what is pending, the next drain is a snapshot.
    pub fn lost(&mut self) {
        self.ops.clear();
        self.pending = 0;
        self.resync = true;
    }

    /// Drains the log: a snapshot (of `held()`, every hash held now) when one is due or
    /// `snapshot` asks for one, else the events since the last drain.
    pub fn drain(&mut self, snapshot: bool, held: impl FnOnce() -> Vec<BlockHash>) -> KvEventBatch {
        let ops = std::mem::take(&mut self.ops);
        self.pending = 0;
        if snapshot || self.resync {
            self.resync = false;
            return KvEventBatch {
                snapshot: Some(held()),
                ops: Vec::new(),
            };
        }
        KvEventBatch {
            snapshot: None,
            ops,
        }
    }
}

/// How an instance hashes its blocks (from its registration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HashScheme {
    /// Tokens per block.
    pub block_size: usize,
    /// The salt its hash chain starts from (model, KV layout).
    pub salt: u64,
}

#[derive(Debug)]
struct Indexed {
    scheme: HashScheme,
    hashes: HashSet<BlockHash>,
    /// Hashes not indexed because of the bound.
    dropped: u64,
}

/// The proxy's view of which blocks each instance holds.
#[derive(Debug)]
pub struct KvIndex {
    by_instance: HashMap<String, Indexed>,
    max_blocks: usize,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(DEFAULT_INDEX_MAX_BLOCKS)
    }
}

impl KvIndex {
    /// An empty index holding at most `max_blocks` hashes per instance.
    pub fn new(max_blocks: usize) -> Self {
        Self {
            by_instance: HashMap::new(),
            max_blocks,
        }
    }

    /// An instance (re)registered with `scheme`: whatever was known of it is dropped (its
    /// snapshot follows).
    pub fn register(&mut self, url: &str, scheme: HashScheme) {
        self.by_instance.insert(
            url.to_string(),
            Indexed {
                scheme,
                hashes: HashSet::new(),
                dropped: 0,
            },
        );
    }

    /// The instance is gone (deregistered, or its connection closed).
    pub fn forget(&mut self, url: &str) {
        self.by_instance.remove(url);
    }

    /// Applies one batch of `url`'s events; ignored for an instance not registered here.
    pub fn apply(&mut self, url: &str, batch: KvEventBatch) {
        let max = self.max_blocks;
        let Some(ix) = self.by_instance.get_mut(url) else {
            return;
        };
        let add = |ix: &mut Indexed, h: BlockHash| {
            if ix.hashes.len() < max {
                ix.hashes.insert(h);
            } else if !ix.hashes.contains(&h) {
                ix.dropped += 1;
            }
        };
        if let Some(all) = batch.snapshot {
            ix.hashes.clear();
            ix.dropped = 0;
            for h in all {
                add(ix, h);
            }
        }
        for op in batch.ops {
            match op {
                KvOp::Stored(v) => v.into_iter().for_each(|h| add(ix, h)),
                KvOp::Removed(v) => {
                    for h in v {
                        ix.hashes.remove(&h);
                    }
                }
            }
        }
    }

    /// How `url` hashes blocks, if it reports KV events.
    pub fn scheme(&self, url: &str) -> Option<HashScheme> {
        self.by_instance.get(url).map(|ix| ix.scheme)
    }

    /// Leading blocks of `hashes` (computed with `url`'s scheme) that `url` holds.
    pub fn overlap(&self, url: &str, hashes: &[BlockHash]) -> usize {
        self.by_instance.get(url).map_or(0, |ix| {
            hashes.iter().take_while(|h| ix.hashes.contains(h)).count()
        })
    }

    /// Hashes indexed per instance URL (and those dropped for the bound).
    pub fn sizes(&self) -> Vec<(String, usize, u64)> {
        let mut v: Vec<_> = self
            .by_instance
            .iter()
            .map(|(u, ix)| (u.clone(), ix.hashes.len(), ix.dropped))
            .collect();
        v.sort();
        v
    }
}

/// A prompt's block hashes under each scheme asked for, computed once per scheme.
#[derive(Debug, Default)]
pub struct PromptHashes<'a> {
    tokens: &'a [u32],
    by_scheme: HashMap<HashScheme, Vec<BlockHash>>,
}

impl<'a> PromptHashes<'a> {
    /// For the prompt `tokens`.
    pub fn new(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            by_scheme: HashMap::new(),
        }
    }

    /// Full blocks of the prompt under `scheme`.
    pub fn blocks(&self, scheme: HashScheme) -> usize {
        self.tokens.len() / scheme.block_size.max(1)
    }

    /// The prompt's hashes under `scheme`.
    pub fn hashes(&mut self, scheme: HashScheme) -> &[BlockHash] {
        let tokens = self.tokens;
        self.by_scheme
            .entry(scheme)
            .or_insert_with(|| block_hashes(scheme.salt, tokens, scheme.block_size.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_order_and_asks_for_a_snapshot_after_losing_events() {
        let mut log = KvEventLog::default();
        // A new log starts with a snapshot.
        let first = log.drain(false, || vec![9]);
        assert_eq!(first.snapshot, Some(vec![9]));
        log.stored(1);
        log.stored(2);
        log.removed(1);
        log.stored(1);
        let b = log.drain(false, || unreachable!("no snapshot is due"));
        assert_eq!(
            b.ops,
            vec![
                KvOp::Stored(vec![1, 2]),
                KvOp::Removed(vec![1]),
                KvOp::Stored(vec![1])
            ]
        );
        assert!(log.drain(false, Vec::new).is_empty());
        for h in 0..=MAX_PENDING_EVENTS as u64 {
            log.stored(h);
        }
        let b = log.drain(false, || vec![7, 8]);
        assert_eq!(
            b.snapshot,
            Some(vec![7, 8]),
            "overflow turns into a snapshot"
        );
        assert!(b.ops.is_empty());
    }

    #[test]
    fn the_index_applies_batches_in_order_and_respects_its_bound() {
        let scheme = HashScheme {
            block_size: 4,
            salt: 3,
        };
        let tokens: Vec<u32> = (0..12).collect();
        let h = block_hashes(3, &tokens, 4);
        let mut ix = KvIndex::new(2);
        ix.apply("a", KvEventBatch::default()); // unknown: ignored
        assert!(ix.sizes().is_empty());
        ix.register("a", scheme);
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(vec![h[0]]),
                ops: vec![KvOp::Stored(vec![h[1], h[2]])],
            },
        );
        assert_eq!(ix.overlap("a", &h), 2, "the third is past the bound");
        assert_eq!(ix.sizes(), vec![("a".to_string(), 2, 1)]);
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: None,
                ops: vec![KvOp::Removed(vec![h[0]])],
            },
        );
        assert_eq!(ix.overlap("a", &h), 0, "overlap counts leading blocks only");
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(h[..2].to_vec()),
                ops: Vec::new(),
            },
        );
        assert_eq!(ix.overlap("a", &h), 2, "a snapshot replaces the set");
        let mut p = PromptHashes::new(&tokens);
        assert_eq!(p.hashes(scheme), &h[..]);
        assert_eq!(p.blocks(scheme), 3);
        ix.forget("a");
        assert_eq!(ix.overlap("a", &h), 0);
    }

    #[test]
    fn batches_round_trip_as_json() {
        let b = KvEventBatch {
            snapshot: Some(vec![u64::MAX, 1]),
            ops: vec![KvOp::Removed(vec![2])],
        };
        let s = serde_json::to_string(&b).unwrap();
        assert_eq!(
            s,
            r#"{"snapshot":[18446744073709551615,1],"ops":[{"removed":[2]}]}"#
        );
        assert_eq!(serde_json::from_str::<KvEventBatch>(&s).unwrap(), b);
    }
}
