//! The KV events an instance sends its proxy (`ControlMessage::KvEvents`): which prefix-cache
//! block hashes its pool and each KV tier gained and lost since the last batch. The log that
//! produces them and the proxy's index that applies them live in `pdserve_core::kv_events`;
//! the batch is here, beside the other control messages, so the wire enum can carry it typed.
//! Its lengths are bounded on receipt ([`super::bounds`]) and the whole batch is checked
//! ([`KvEventBatch::check`]) before any of it reaches the index.

use serde::{Deserialize, Serialize};

/// A block's chained prefix-cache hash (`pdserve_core::prefix::BlockHash`).
pub type BlockHash = u64;

/// Events kept between two drains before the log gives up and asks for a snapshot instead.
pub const MAX_PENDING_EVENTS: usize = 1 << 16;

/// A run of events of one kind, in the order they happened.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
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

    /// This medium's bit in a set of media (one `u8`).
    pub fn bit(self) -> u8 {
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
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct TierEvents {
    /// `host`, `disk` or `shared` ([`Medium::as_str`]); checked by `pdserve_core::kv_events::KvIndex::apply`.
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
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
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
