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
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub use pdserve_runtime::config::TierCredit;

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

/// Where an instance holds a block: its block pool or one of its KV tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The block pool (device memory on a GPU instance): reused as is.
    Pool,
    /// The host spill region.
    Host,
    /// The local disk tier.
    Disk,
    /// The store several instances share (a directory or Redis).
    Shared,
}

impl Medium {
    /// Every medium, top down.
    pub const ALL: [Medium; 4] = [Medium::Pool, Medium::Host, Medium::Disk, Medium::Shared];

    /// The wire name and metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Pool => "pool",
            Medium::Host => "host",
            Medium::Disk => "disk",
            Medium::Shared => "shared",
        }
    }

    /// The medium named `name` on the wire.
    ///
    /// # Errors
    /// [`KvEventsError::UnknownMedium`] for any other name (at most 32 bytes of it are kept).
    pub fn parse(name: &str) -> Result<Self, KvEventsError> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == name)
            .ok_or_else(|| {
                let mut end = name.len().min(32);
                while !name.is_char_boundary(end) {
                    end -= 1;
                }
                KvEventsError::UnknownMedium(name[..end].to_string())
            })
    }

    /// The weight of an overlap found at this medium.
    pub fn credit(self, c: &TierCredit) -> f64 {
        match self {
            Medium::Pool => 1.0,
            Medium::Host => c.host,
            Medium::Disk => c.disk,
            Medium::Shared => c.shared,
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// Why the proxy refused a batch of KV events (none of it was applied).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventsError {
    /// A tier's events name a medium this proxy does not know.
    #[error("unknown medium {0:?}")]
    UnknownMedium(String),
    /// The pool's events are the batch's own `snapshot`/`ops`, not a tier's.
    #[error("the pool's events came as a tier's")]
    PoolAsTier,
    /// Two tiers' events name the same medium.
    #[error("medium {0} twice in one batch")]
    RepeatedMedium(&'static str),
    /// More events for one medium than an instance's log holds between two drains.
    #[error("{got} events for medium {medium}, at most {max}")]
    TooManyEvents {
        /// The medium.
        medium: &'static str,
        /// Events (hashes in its ops) in the batch.
        got: usize,
        /// [`MAX_PENDING_EVENTS`].
        max: usize,
    },
}

impl KvEventsError {
    /// A stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownMedium(_) => "unknown_medium",
            Self::PoolAsTier => "pool_as_tier",
            Self::RepeatedMedium(_) => "repeated_medium",
            Self::TooManyEvents { .. } => "too_many_events",
        }
    }
}

/// One KV tier's events in a batch: like the pool's, for the blocks held at `medium`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct TierEvents {
    /// `host`, `disk` or `shared` ([`Medium::as_str`]); checked by [`KvIndex::apply`].
    pub medium: String,
    /// Every hash the tier holds now: replaces what the proxy knew of this medium.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Vec<BlockHash>>,
    /// Events since the previous batch (after `snapshot`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<KvOp>,
}

impl TierEvents {
    /// A drain of `medium`'s log.
    pub fn new(medium: Medium, drained: KvEventBatch) -> Self {
        Self {
            medium: medium.as_str().to_string(),
            snapshot: drained.snapshot,
            ops: drained.ops,
        }
    }
}

/// What one drain of an instance's log carries.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct KvEventBatch {
    /// Every hash the instance's pool holds now: replaces the proxy's view of its pool.
    /// `None` for a delta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Vec<BlockHash>>,
    /// The pool's events since the previous batch (after `snapshot` when both are present).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<KvOp>,
    /// Each KV tier's events (none without tiers; a tier without events is left out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<TierEvents>,
}

impl KvEventBatch {
    /// Whether it carries nothing (a delta without events).
    pub fn is_empty(&self) -> bool {
        self.snapshot.is_none() && self.ops.is_empty() && self.tiers.is_empty()
    }

    /// Checks the batch whole: each tier's medium known and given once, each medium's events
    /// within what a log holds between two drains. Returns the tiers' media in order.
    ///
    /// # Errors
    /// The first [`KvEventsError`] found.
    pub fn check(&self) -> Result<Vec<Medium>, KvEventsError> {
        let events = |ops: &[KvOp]| -> usize {
            ops.iter()
                .map(|op| match op {
                    KvOp::Stored(v) | KvOp::Removed(v) => v.len(),
                })
                .sum()
        };
        let bounded = |medium: Medium, ops: &[KvOp]| {
            let got = events(ops);
            if got > MAX_PENDING_EVENTS {
                return Err(KvEventsError::TooManyEvents {
                    medium: medium.as_str(),
                    got,
                    max: MAX_PENDING_EVENTS,
                });
            }
            Ok(())
        };
        bounded(Medium::Pool, &self.ops)?;
        let mut seen: u8 = 0;
        let mut media = Vec::with_capacity(self.tiers.len().min(Medium::ALL.len()));
        for t in &self.tiers {
            let m = Medium::parse(&t.medium)?;
            if m == Medium::Pool {
                return Err(KvEventsError::PoolAsTier);
            }
            if seen & m.bit() != 0 {
                return Err(KvEventsError::RepeatedMedium(m.as_str()));
            }
            seen |= m.bit();
            bounded(m, &t.ops)?;
            media.push(m);
        }
        Ok(media)
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
                .map(|m| m.credit(credit))
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
