//! KV events: which prefix-cache blocks each instance holds, told to the proxy, and the
//! proxy's index of them (what the KV-aware router reads).
//!
//! An instance's [`BlockManager`](crate::block_manager::BlockManager) logs every block hash it
//! registers (*stored*) and every one it forgets (*removed*: evicted, or the cache cleared),
//! in order, in a bounded [`KvEventLog`]. Its control plane drains the log every
//! `KV_EVENTS_INTERVAL` (`pdserve_actors::control_plane`) and sends the batch to the proxy as
//! a typed control message (`ControlMessage::KvEvents`, an rkyv [`KvEventBatch`], bounded on
//! receipt by `pdserve_runtime::wire::bounds`). Right after each (re)registration, and whenever the log overflowed or
//! the cache was cleared, the batch is a *snapshot*: every hash the instance holds, which
//! replaces what the proxy knew. A restarted proxy or instance therefore converges within
//! 100 ms of its registration.
//!
//! The proxy keeps a [`KvIndex`]: per instance URL, the set of hashes it holds, bounded by
//! `proxy.kv_index_max_blocks` per instance (hashes past the bound are not indexed and
//! counted as dropped; the index under-reports a very large cache, it never over-reports).
//! The overlap of a prompt with an instance is the number of its leading block hashes, chained
//! with that instance's salt and block size as given in its registration, found in that set.
//!
//! **Media.** The pool's events are the batch's `snapshot`/`ops`. An instance with KV tiers
//! (`pdserve_actors::kv_tiers`) adds one [`TierEvents`] per tier in `tiers`: the hashes its
//! host region, disk tier or shared store holds (the shared store: every block this instance's
//! index of the store lists, whoever wrote it, so each instance sharing a store reports it),
//! stored when a block lands there and removed when the tier drops it. The index keeps the
//! media of each (instance, block); the router credits a prefix block at its best medium's
//! weight ([`TierCredit`], `proxy.kv_tier_credit`), so an overlap that must be loaded back
//! from a lower tier counts less than one in the pool, and more than none. A batch is checked
//! whole before any of it reaches the index ([`KvIndex::apply`]): an unknown medium, a
//! repeated one or more events than a log can hold refuse it with a [`KvEventsError`].

use crate::prefix::{block_hashes, BlockHash};
use std::collections::HashMap;

pub use pdserve_runtime::config::TierCredit;

/// Default bound on the hashes the proxy indexes per instance (`proxy.kv_index_max_blocks`).
pub const DEFAULT_INDEX_MAX_BLOCKS: usize = 1 << 20;

/// The weight of an overlap found at medium `m` (`proxy.kv_tier_credit`; the pool's is 1).
pub fn medium_credit(m: Medium, c: &TierCredit) -> f64 {
    match m {
        Medium::Pool => 1.0,
        Medium::Host => c.host,
        Medium::Disk => c.disk,
        Medium::Shared => c.shared,
    }
}

pub use pdserve_runtime::wire::kv_events::{
    KvEventBatch, KvEventsError, KvOp, Medium, TierEvents, MAX_PENDING_EVENTS,
};

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
                ..KvEventBatch::default()
            };
        }
        KvEventBatch {
            ops,
            ..KvEventBatch::default()
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
    /// Hash → the media holding it (a bit per [`Medium`]).
    held: HashMap<BlockHash, u8>,
    /// Hashes held at each medium (by [`Medium`] order).
    per_medium: [usize; 4],
    /// Hashes not indexed because of the bound.
    dropped: u64,
}

impl Indexed {
    fn add(&mut self, max: usize, m: Medium, h: BlockHash) {
        if let Some(media) = self.held.get_mut(&h) {
            if *media & m.bit() == 0 {
                *media |= m.bit();
                self.per_medium[m as usize] += 1;
            }
        } else if self.held.len() < max {
            self.held.insert(h, m.bit());
            self.per_medium[m as usize] += 1;
        } else {
            self.dropped += 1;
        }
    }

    fn remove(&mut self, m: Medium, h: BlockHash) {
        if let Some(media) = self.held.get_mut(&h) {
            if *media & m.bit() != 0 {
                *media &= !m.bit();
                self.per_medium[m as usize] -= 1;
                if *media == 0 {
                    self.held.remove(&h);
                }
            }
        }
    }

    /// Forgets every hash held at `m`.
    fn clear(&mut self, m: Medium) {
        self.held.retain(|_, media| {
            *media &= !m.bit();
            *media != 0
        });
        self.per_medium[m as usize] = 0;
    }

    fn apply(&mut self, max: usize, m: Medium, snapshot: Option<Vec<BlockHash>>, ops: Vec<KvOp>) {
        if let Some(all) = snapshot {
            self.clear(m);
            if m == Medium::Pool {
                self.dropped = 0;
            }
            for h in all {
                self.add(max, m, h);
            }
        }
        for op in ops {
            match op {
                KvOp::Stored(v) => v.into_iter().for_each(|h| self.add(max, m, h)),
                KvOp::Removed(v) => v.into_iter().for_each(|h| self.remove(m, h)),
            }
        }
    }
}

/// The proxy's view of which blocks each instance holds, and where.
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

/// What the index holds of one instance ([`KvIndex::sizes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSize {
    /// The instance's URL.
    pub url: String,
    /// Distinct hashes indexed (at any medium).
    pub blocks: usize,
    /// Hashes not indexed because of the bound.
    pub dropped: u64,
    /// Hashes held at each medium that holds any, top down.
    pub by_medium: Vec<(Medium, usize)>,
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
                held: HashMap::new(),
                per_medium: [0; 4],
                dropped: 0,
            },
        );
    }

    /// The instance is gone (deregistered, or its connection closed).
    pub fn forget(&mut self, url: &str) {
        self.by_instance.remove(url);
    }

    /// Applies one batch of `url`'s events; ignored for an instance not registered here.
    ///
    /// # Errors
    /// A batch that fails [`KvEventBatch::check`] is refused whole: nothing of it is applied,
    /// and what the index knew of `url` is dropped (its events are now out of step, and the
    /// index must not over-report), until its next snapshot.
    pub fn apply(&mut self, url: &str, batch: KvEventBatch) -> Result<(), KvEventsError> {
        let max = self.max_blocks;
        let Some(ix) = self.by_instance.get_mut(url) else {
            return Ok(());
        };
        let media = match batch.check() {
            Ok(media) => media,
            Err(e) => {
                Medium::ALL.into_iter().for_each(|m| ix.clear(m));
                return Err(e);
            }
        };
        ix.apply(max, Medium::Pool, batch.snapshot, batch.ops);
        for (m, t) in media.into_iter().zip(batch.tiers) {
            ix.apply(max, m, t.snapshot, t.ops);
        }
        Ok(())
    }

    /// How `url` hashes blocks, if it reports KV events.
    pub fn scheme(&self, url: &str) -> Option<HashScheme> {
        self.by_instance.get(url).map(|ix| ix.scheme)
    }

    /// Leading blocks of `hashes` (computed with `url`'s scheme) that `url` holds, at any
    /// medium.
    pub fn overlap(&self, url: &str, hashes: &[BlockHash]) -> usize {
        self.by_instance.get(url).map_or(0, |ix| {
            hashes
                .iter()
                .take_while(|h| ix.held.contains_key(h))
                .count()
        })
    }

    /// The leading blocks of `hashes` that `url` holds at any medium, and their credit: each
    /// block weighs what its best medium is worth in `credit` (1 in the pool).
    pub fn credit(&self, url: &str, hashes: &[BlockHash], credit: &TierCredit) -> (usize, f64) {
        let Some(ix) = self.by_instance.get(url) else {
            return (0, 0.0);
        };
        let mut n = 0;
        let mut sum = 0.0;
        for h in hashes {
            let Some(&media) = ix.held.get(h) else { break };
            n += 1;
            sum += Medium::ALL
                .into_iter()
                .filter(|m| media & m.bit() != 0)
                .map(|m| medium_credit(m, credit))
                .fold(0.0, f64::max);
        }
        (n, sum)
    }

    /// What is indexed per instance URL, sorted by URL.
    pub fn sizes(&self) -> Vec<IndexSize> {
        let mut v: Vec<_> = self
            .by_instance
            .iter()
            .map(|(u, ix)| IndexSize {
                url: u.clone(),
                blocks: ix.held.len(),
                dropped: ix.dropped,
                by_medium: Medium::ALL
                    .into_iter()
                    .map(|m| (m, ix.per_medium[m as usize]))
                    .filter(|&(_, n)| n > 0)
                    .collect(),
            })
            .collect();
        v.sort_by(|a, b| a.url.cmp(&b.url));
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
        ix.apply("a", KvEventBatch::default()).unwrap(); // unknown: ignored
        assert!(ix.sizes().is_empty());
        ix.register("a", scheme);
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(vec![h[0]]),
                ops: vec![KvOp::Stored(vec![h[1], h[2]])],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.overlap("a", &h), 2, "the third is past the bound");
        let size = &ix.sizes()[0];
        assert_eq!((size.url.as_str(), size.blocks, size.dropped), ("a", 2, 1));
        assert_eq!(size.by_medium, vec![(Medium::Pool, 2)]);
        ix.apply(
            "a",
            KvEventBatch {
                ops: vec![KvOp::Removed(vec![h[0]])],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.overlap("a", &h), 0, "overlap counts leading blocks only");
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(h[..2].to_vec()),
                ..Default::default()
            },
        )
        .unwrap();
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
            ..Default::default()
        };
        let s = serde_json::to_string(&b).unwrap();
        assert_eq!(
            s, r#"{"snapshot":[18446744073709551615,1],"ops":[{"removed":[2]}]}"#,
            "a batch without tiers is what it was before them"
        );
        assert_eq!(serde_json::from_str::<KvEventBatch>(&s).unwrap(), b);
        let mut log = KvEventLog::default();
        let _ = log.drain(false, Vec::new);
        log.stored(5);
        let b = KvEventBatch {
            tiers: vec![TierEvents::new(Medium::Host, log.drain(false, Vec::new))],
            ..Default::default()
        };
        let s = serde_json::to_string(&b).unwrap();
        assert_eq!(s, r#"{"tiers":[{"medium":"host","ops":[{"stored":[5]}]}]}"#);
        assert_eq!(serde_json::from_str::<KvEventBatch>(&s).unwrap(), b);
    }

    fn tier(medium: &str, snapshot: Option<Vec<BlockHash>>, ops: Vec<KvOp>) -> TierEvents {
        TierEvents {
            medium: medium.into(),
            snapshot,
            ops,
        }
    }

    #[test]
    fn the_index_keeps_each_blocks_media_and_credits_the_best() {
        let scheme = HashScheme {
            block_size: 4,
            salt: 3,
        };
        let tokens: Vec<u32> = (0..16).collect();
        let h = block_hashes(3, &tokens, 4);
        let credit = TierCredit {
            host: 0.8,
            disk: 0.5,
            shared: 0.25,
        };
        let mut ix = KvIndex::new(100);
        ix.register("a", scheme);
        ix.register("b", scheme);
        // a: block 0 in the pool, 1 in its host region, 2 on disk; b: 0..3 in the shared store.
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(vec![h[0]]),
                tiers: vec![
                    tier("host", Some(vec![h[1]]), Vec::new()),
                    tier("disk", None, vec![KvOp::Stored(vec![h[2]])]),
                ],
                ..Default::default()
            },
        )
        .unwrap();
        ix.apply(
            "b",
            KvEventBatch {
                tiers: vec![tier("shared", Some(h[..3].to_vec()), Vec::new())],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.credit("a", &h, &credit), (3, 1.0 + 0.8 + 0.5));
        assert_eq!(ix.credit("b", &h, &credit), (3, 0.75));
        assert_eq!(
            ix.overlap("a", &h),
            3,
            "held anywhere counts for the overlap"
        );
        assert_eq!(ix.credit("nobody", &h, &credit), (0, 0.0));
        // The pool evicts block 0 into the host region: still held, at 0.8.
        ix.apply(
            "a",
            KvEventBatch {
                ops: vec![KvOp::Removed(vec![h[0]])],
                tiers: vec![tier("host", None, vec![KvOp::Stored(vec![h[0]])])],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.credit("a", &h, &credit), (3, 0.8 + 0.8 + 0.5));
        // Block 1 also back in the pool (tiers keep a block after a hit): the best counts.
        ix.apply(
            "a",
            KvEventBatch {
                ops: vec![KvOp::Stored(vec![h[1]])],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.credit("a", &h, &credit), (3, 0.8 + 1.0 + 0.5));
        let size = &ix.sizes()[0];
        assert_eq!(size.blocks, 3);
        assert_eq!(
            size.by_medium,
            vec![(Medium::Pool, 1), (Medium::Host, 2), (Medium::Disk, 1)]
        );
        // The host region drops block 0 (its LRU), then sends a snapshot without block 1:
        // block 0 is held nowhere, so the run stops at once.
        ix.apply(
            "a",
            KvEventBatch {
                tiers: vec![tier(
                    "host",
                    Some(Vec::new()),
                    vec![KvOp::Removed(vec![h[0]])],
                )],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.credit("a", &h, &credit), (0, 0.0));
        assert_eq!(
            ix.credit("a", &h[1..], &credit),
            (2, 1.5),
            "pool and disk stay"
        );
        // A pool snapshot leaves the tiers' blocks alone.
        ix.apply(
            "a",
            KvEventBatch {
                snapshot: Some(Vec::new()),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(ix.credit("a", &h[2..], &credit), (1, 0.5));
        assert_eq!(ix.sizes()[0].by_medium, vec![(Medium::Disk, 1)]);
    }

    #[test]
    fn a_bad_batch_is_refused_whole_with_a_typed_error() {
        let scheme = HashScheme {
            block_size: 4,
            salt: 3,
        };
        let mut ix = KvIndex::new(100);
        ix.register("a", scheme);
        let good = || KvEventBatch {
            snapshot: Some(vec![1, 2]),
            tiers: vec![tier("host", Some(vec![3]), Vec::new())],
            ..Default::default()
        };
        ix.apply("a", good()).unwrap();
        assert_eq!(ix.sizes()[0].blocks, 3);
        let refused = |ix: &mut KvIndex, b: KvEventBatch| {
            let e = ix.apply("a", b).unwrap_err();
            assert_eq!(ix.sizes()[0].blocks, 0, "{e}: nothing stale is kept");
            ix.apply("a", good()).unwrap();
            e
        };
        let mut b = good();
        b.tiers
            .push(tier("tape", None, vec![KvOp::Stored(vec![9])]));
        let e = refused(&mut ix, b);
        assert_eq!(e, KvEventsError::UnknownMedium("tape".into()));
        assert_eq!(e.kind(), "unknown_medium");
        let long = "x".repeat(10_000);
        let e = refused(
            &mut ix,
            KvEventBatch {
                tiers: vec![tier(&long, None, Vec::new())],
                ..Default::default()
            },
        );
        assert_eq!(
            e,
            KvEventsError::UnknownMedium("x".repeat(32)),
            "kept short"
        );
        let e = refused(
            &mut ix,
            KvEventBatch {
                tiers: vec![tier("pool", None, Vec::new())],
                ..Default::default()
            },
        );
        assert_eq!(e, KvEventsError::PoolAsTier);
        let e = refused(
            &mut ix,
            KvEventBatch {
                tiers: vec![
                    tier("disk", None, Vec::new()),
                    tier("disk", None, Vec::new()),
                ],
                ..Default::default()
            },
        );
        assert_eq!(e, KvEventsError::RepeatedMedium("disk"));
        let many: Vec<BlockHash> = (0..=MAX_PENDING_EVENTS as u64).collect();
        let e = refused(
            &mut ix,
            KvEventBatch {
                tiers: vec![tier(
                    "shared",
                    None,
                    vec![
                        KvOp::Stored(many[..10].to_vec()),
                        KvOp::Removed(many.clone()),
                    ],
                )],
                ..Default::default()
            },
        );
        assert_eq!(e.kind(), "too_many_events");
        let e = refused(
            &mut ix,
            KvEventBatch {
                ops: vec![KvOp::Stored(many)],
                ..Default::default()
            },
        );
        assert!(e.to_string().contains("medium pool"), "{e}");
        // JSON with an unknown medium parses, and is then refused by the index.
        let b: KvEventBatch =
            serde_json::from_str(r#"{"tiers":[{"medium":"hbm3","ops":[{"stored":[1]}]}]}"#)
                .unwrap();
        assert!(matches!(
            ix.apply("a", b),
            Err(KvEventsError::UnknownMedium(m)) if m == "hbm3"
        ));
    }
}
