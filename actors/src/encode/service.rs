//! The encode instance's side of the encoder protocol: its hold region and the holds in it.
//!
//! The encoder cache ([`EncoderCache`]) keeps each image's embeddings by digest. A reader asks
//! for some of them with [`EcRequest::Hold`]: each is copied into a free **slot** of the hold
//! region — one transfer-engine region of `multimodal.encoder_hold_slots` slots of one image's
//! embeddings each — and the slots stay held under a lease (`transfer.kv_lease_ms`) until the
//! reader releases them or the lease ends. On backends with fenced scopes (`tcp`, `quic`,
//! `rdma`) the reader's session sees exactly the hold's slots, in a scope fenced by the hold's
//! id: once the hold ends, no read of it is served any more, so a slot handed to the next hold
//! is never read by the last one. The cache itself is never read remotely, so it evicts
//! freely.

use super::protocol::{EcAnswer, EcRequest, EncoderError, EncoderInfo, HeldImages, EC_VERSION};
use crate::handoff::protocol::SessionOffer;
use crate::handoff::session::{fence_id, Grants, Security};
use crate::handoff::Caller;
use crate::multimodal::EncoderCache;
use pdserve_gpu::vision::{ImageDigest, VisionTower};
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{Access, FenceScope, RegionGrant, RegisteredRegion, TransferEngine};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes of image embeddings encode instances copied into hold slots for readers.
pub const ENCODER_BYTES_HELD_TOTAL: &str = "pdserve_encoder_bytes_held_total";
/// Hold slots in use on an encode instance.
pub const ENCODER_HOLD_SLOTS_USED: &str = "pdserve_encoder_hold_slots_used";

/// What an encode instance is built from.
pub struct EncoderSettings {
    /// Its engine id (instance name).
    pub engine_id: String,
    /// The model's identity ([`EncoderInfo::model`]).
    pub model: String,
    /// Hold slots (each one image's embeddings).
    pub slots: usize,
    /// How long a hold lives unless released.
    pub lease: Duration,
}

/// The encode instance's protocol service: the tower's shape, the cache, the hold region.
pub struct EncoderService {
    info: EncoderInfo,
    cache: Arc<EncoderCache>,
    region: RegisteredRegion,
    grants: Grants,
    lease: Duration,
    holds: Mutex<Holds>,
    /// Holds handed out since the start.
    served: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct Holds {
    free: Vec<u32>,
    by_id: HashMap<TransferId, Hold>,
}

struct Hold {
    slots: Vec<u32>,
    until: Instant,
    // Held for its drop: dropping the scope fences it.
    _scope: Option<FenceScope>,
}

/// Hold figures (for `inspect` and metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HoldFigures {
    /// Slots in the region.
    pub slots: usize,
    /// Slots held for readers now.
    pub used: usize,
    /// Holds open now.
    pub holds: usize,
    /// Holds handed out since the instance started.
    pub served: u64,
}

impl EncoderService {
    /// Registers the hold region on `engine` for `tower`'s embeddings.
    ///
    /// # Errors
    /// [`EncoderError::NotSupported`] when the region cannot be allocated or registered.
    pub fn new(
        settings: EncoderSettings,
        engine: Arc<TransferEngine>,
        tower: &VisionTower,
        cache: Arc<EncoderCache>,
    ) -> Result<Self, EncoderError> {
        let cfg = tower.config();
        let rows = cfg.tokens_per_image();
        let width = cfg.text_hidden_size;
        let slot_bytes = (rows * width * std::mem::size_of::<f32>()) as u64;
        let slots = settings.slots.max(1);
        let region = engine
            .allocate_and_register(slots * slot_bytes as usize)
            .map_err(|e| EncoderError::NotSupported(format!("the hold region: {e}")))?;
        let info = EncoderInfo {
            version: EC_VERSION,
            engine_id: settings.engine_id,
            model: settings.model,
            backend: engine.backend().to_string(),
            transfer_addr: engine.address(),
            preprocessing: cfg.preprocessing_key(),
            rows: rows as u32,
            width: width as u32,
            region: region.id(),
            region_bytes: region.len(),
            slot_bytes,
        };
        metrics::gauge!(ENCODER_HOLD_SLOTS_USED).set(0.0);
        Ok(Self {
            info,
            cache,
            region,
            grants: Grants::new(engine),
            lease: settings.lease,
            holds: Mutex::new(Holds {
                free: (0..slots as u32).rev().collect(),
                by_id: HashMap::new(),
            }),
            served: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The handshake's answer.
    pub fn info(&self) -> &EncoderInfo {
        &self.info
    }

    /// The encoder cache.
    pub fn cache(&self) -> &Arc<EncoderCache> {
        &self.cache
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holds> {
        // Consistent after every statement.
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Slots and holds now.
    pub fn figures(&self) -> HoldFigures {
        let h = self.lock();
        let slots = (self.info.region_bytes / self.info.slot_bytes.max(1)) as usize;
        HoldFigures {
            slots,
            used: slots - h.free.len(),
            holds: h.by_id.len(),
            served: self.served.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Answers one request (a failure is [`EcAnswer::Failed`]).
    pub fn handle(&self, request: EcRequest, caller: Caller<'_>) -> EcAnswer {
        let name = request.name();
        self.expire(Instant::now());
        let answer = match request {
            EcRequest::Info => Ok(EcAnswer::Info(self.info.clone())),
            EcRequest::OpenSession { initiator, fresh } => self
                .open_session(&initiator, fresh, caller.node)
                .map(EcAnswer::Session),
            EcRequest::Hold {
                hold,
                initiator,
                digests,
            } => self
                .hold(hold, &initiator, &digests, caller.node)
                .map(EcAnswer::Held),
            EcRequest::Release(hold) => Ok(EcAnswer::Released {
                was_held: self.release(hold),
            }),
        };
        answer.unwrap_or_else(|e| {
            tracing::debug!(request = name, kind = e.kind(), error = %e, "encoder request failed");
            EcAnswer::Failed(e)
        })
    }

    fn open_session(
        &self,
        initiator: &str,
        fresh: bool,
        caller: Option<&str>,
    ) -> Result<SessionOffer, EncoderError> {
        check_caller(initiator, caller)?;
        let grant = self
            .grants
            .for_peer(initiator, None, fresh, &[self.region.id()], Access::Read)
            .map_err(|e| EncoderError::NotSupported(e.to_string()))?;
        Ok(SessionOffer::from(grant.offer()))
    }

    fn hold(
        &self,
        hold: TransferId,
        initiator: &str,
        digests: &[[u8; 32]],
        caller: Option<&str>,
    ) -> Result<HeldImages, EncoderError> {
        check_caller(initiator, caller)?;
        // Every image must be here before a slot is taken.
        let embeds = digests
            .iter()
            .map(|d| {
                let digest = ImageDigest(*d);
                self.cache
                    .get(&digest)
                    .ok_or_else(|| EncoderError::NotCached(digest.short()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let slot_bytes = self.info.slot_bytes;
        let security = self.grants.security();
        let grant = match security {
            Security::None => None,
            _ => Some(self.grants.current(initiator).ok_or_else(|| {
                EncoderError::BadRequest(format!(
                    "{initiator} has no transfer session here: open one first"
                ))
            })?),
        };
        // Slots are taken under the lock; they are filled outside it (a taken slot is no one
        // else's until it is freed again).
        let slots: Vec<u32> = {
            let mut h = self.lock();
            if h.by_id.contains_key(&hold) {
                return Err(EncoderError::BadRequest(format!(
                    "hold {hold} is open already"
                )));
            }
            if h.free.len() < embeds.len() {
                return Err(EncoderError::Overloaded(format!(
                    "{} of the {} hold slots are free, the request needs {} (multimodal.encoder_hold_slots)",
                    h.free.len(),
                    self.region.len() / slot_bytes,
                    embeds.len()
                )));
            }
            (0..embeds.len())
                .map(|_| h.free.pop().expect("checked"))
                .collect()
        };
        let offsets: Vec<u64> = slots.iter().map(|&s| u64::from(s) * slot_bytes).collect();
        let fill = || -> Result<Option<FenceScope>, EncoderError> {
            let mut bytes = Vec::with_capacity(slot_bytes as usize);
            for (e, &off) in embeds.iter().zip(&offsets) {
                if (e.data.len() * 4) as u64 != slot_bytes {
                    return Err(EncoderError::NotSupported(format!(
                        "cached embeddings of {} values do not fill a slot of {slot_bytes} bytes",
                        e.data.len()
                    )));
                }
                bytes.clear();
                bytes.extend(e.data.iter().flat_map(|v| v.to_le_bytes()));
                self.region
                    .write_at(off, &bytes)
                    .map_err(|e| EncoderError::transfer(&e))?;
            }
            let ranges: Vec<RegionGrant> = offsets
                .iter()
                .map(|&off| RegionGrant::range(self.region.id(), off, slot_bytes, Access::Read))
                .collect();
            match &grant {
                Some(g) => g
                    .scope(security, hold, &ranges)
                    .map_err(|e| EncoderError::NotSupported(e.to_string())),
                None => Ok(None),
            }
        };
        let filled = fill();
        let mut h = self.lock();
        let scope = match filled {
            Ok(_) if h.by_id.contains_key(&hold) => {
                // The same hold id opened by a concurrent call meanwhile.
                h.free.extend(slots);
                return Err(EncoderError::BadRequest(format!(
                    "hold {hold} is open already"
                )));
            }
            Ok(s) => s,
            Err(e) => {
                h.free.extend(slots);
                return Err(e);
            }
        };
        h.by_id.insert(
            hold,
            Hold {
                slots,
                until: Instant::now() + self.lease,
                _scope: scope,
            },
        );
        self.served
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        metrics::counter!(ENCODER_BYTES_HELD_TOTAL).increment(offsets.len() as u64 * slot_bytes);
        self.gauge(&h);
        tracing::debug!(%hold, images = offsets.len(), fence = fence_id(hold), "image embeddings held");
        Ok(HeldImages {
            hold,
            offsets,
            lease_ms: self.lease.as_millis() as u64,
        })
    }

    fn gauge(&self, h: &Holds) {
        let slots = self.region.len() / self.info.slot_bytes.max(1);
        metrics::gauge!(ENCODER_HOLD_SLOTS_USED).set((slots as usize - h.free.len()) as f64);
    }

    /// Frees `hold` (fencing its scope); whether it was still held.
    pub fn release(&self, hold: TransferId) -> bool {
        let mut h = self.lock();
        let Some(held) = h.by_id.remove(&hold) else {
            return false;
        };
        // The scope is fenced (dropped) before its slots can be handed out again.
        let Hold { slots, _scope, .. } = held;
        drop(_scope);
        h.free.extend(slots);
        self.gauge(&h);
        true
    }

    /// Ends the holds whose lease ran out.
    pub fn expire(&self, now: Instant) {
        let mut h = self.lock();
        let expired: Vec<TransferId> = h
            .by_id
            .iter()
            .filter(|(_, v)| v.until <= now)
            .map(|(k, _)| *k)
            .collect();
        for id in expired {
            if let Some(Hold { slots, _scope, .. }) = h.by_id.remove(&id) {
                drop(_scope);
                tracing::info!(hold = %id, "image embeddings hold expired unreleased");
                h.free.extend(slots);
            }
        }
        self.gauge(&h);
    }

    /// Ends expired holds every `interval` while the service lives.
    pub fn expire_every(self: &Arc<Self>, interval: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(s) => s.expire(Instant::now()),
                    None => return,
                }
            }
        });
    }

    /// Revokes every session (the instance stops).
    pub fn revoke_all(&self) {
        self.grants.revoke_all();
    }
}

fn check_caller(initiator: &str, caller: Option<&str>) -> Result<(), EncoderError> {
    match caller {
        Some(c) if c != initiator => Err(EncoderError::BadRequest(format!(
            "node `{c}` cannot act for `{initiator}`"
        ))),
        _ => Ok(()),
    }
}
