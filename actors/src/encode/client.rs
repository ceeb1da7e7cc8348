//! The reading side of the encoder protocol: an instance that needs a request's image
//! embeddings (a prefill, colocated or decode instance of a vision-language model) takes them
//! from the encode instance that holds them, over the transfer engine.
//!
//! One fetch: the handshake ([`EcRequest::Info`], cached per encoder and checked against our
//! model, preprocessing, row shape and backend), a read session (granted over the protocol on
//! every backend with sessions, cached per encoder), a hold of the images' slots, one batch of
//! reads into a scratch region of ours, and the release — whose answer says whether the hold
//! was still alive, so a read that outlived its lease is void, never used. Any failure after
//! the hold releases it; a failure that may leave the session stuck drops it (the next fetch
//! opens a new one).

use super::protocol::{
    decode_answer, encode_request, EcAnswer, EcRequest, EncoderError, EncoderInfo, HeldImages,
    EC_CONTENT_TYPE, EC_VERSION, MAX_FRAME_BYTES, MAX_HOLD_IMAGES,
};
use crate::handoff::peer::Peers;
use crate::handoff::session::{fence_id, Security};
use crate::handoff::HandoffError;
use dashmap::DashMap;
use pdserve_gpu::vision::{ImageDigest, ImageEmbeds};
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{
    RegisteredRegion, Session, SessionCredentials, SessionKey, Side, TransferEngine, TransferOp,
    TransportError,
};
use std::sync::Arc;
use std::time::Duration;

/// Image embeddings fetched from encode instances (`result="ok"` or the failure's kind).
pub const ENCODER_FETCHES_TOTAL: &str = "pdserve_encoder_fetches_total";
/// Bytes of image embeddings read from encode instances.
pub const ENCODER_BYTES_FETCHED_TOTAL: &str = "pdserve_encoder_bytes_fetched_total";
/// Seconds to take one request's image embeddings from an encode instance.
pub const ENCODER_FETCH_SECONDS: &str = "pdserve_encoder_fetch_seconds";

/// What the embeddings must look like here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// Our model's identity ([`EncoderInfo::model`]).
    pub model: String,
    /// Our tower's preprocessing key.
    pub preprocessing: String,
    /// Rows per image.
    pub rows: usize,
    /// Width of a row.
    pub width: usize,
}

/// Takes image embeddings from encode instances.
pub struct EncoderClient {
    engine_id: String,
    engine: Arc<TransferEngine>,
    /// The instance's peer client, the protocol's carrier: its control plane to encoders
    /// with cluster credentials, else their HTTP route.
    peers: Arc<Peers>,
    timeout: Duration,
    expect: Expect,
    infos: DashMap<String, EncoderInfo>,
    sessions: DashMap<String, Arc<Session>>,
    /// Registered scratch regions of finished reads, kept for later ones (a registration is a
    /// round of its own on some backends); at most [`SCRATCH_KEPT`].
    scratch: std::sync::Mutex<Vec<RegisteredRegion>>,
}

/// Scratch regions an [`EncoderClient`] keeps between fetches.
const SCRATCH_KEPT: usize = 4;

impl EncoderClient {
    /// A client reading into `engine`'s memory, naming itself `engine_id`, calling encoders
    /// through `peers`; every step bounded by `timeout`.
    pub fn new(
        engine_id: String,
        engine: Arc<TransferEngine>,
        peers: Arc<Peers>,
        timeout: Duration,
        expect: Expect,
    ) -> Self {
        Self {
            engine_id,
            engine,
            peers,
            timeout,
            expect,
            infos: DashMap::new(),
            sessions: DashMap::new(),
            scratch: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A registered region of at least `len` bytes: the smallest kept one that fits, else a
    /// new one.
    fn take_scratch(&self, len: usize) -> Result<RegisteredRegion, EncoderError> {
        {
            let mut kept = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let best = kept
                .iter()
                .enumerate()
                .filter(|(_, r)| r.len() >= len as u64)
                .min_by_key(|(_, r)| r.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(kept.swap_remove(i));
            }
        }
        self.engine
            .allocate_and_register(len)
            .map_err(|e| EncoderError::transfer(&e))
    }

    /// Keeps `region` for a later read. Only a region whose reads all completed comes back
    /// here: one a failed or timed-out read may still write into is dropped (deregistered).
    fn keep_scratch(&self, region: RegisteredRegion) {
        let mut kept = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < SCRATCH_KEPT {
            kept.push(region);
        }
    }

    /// The embeddings of `digests` (in order) from the encode instance at `url`.
    ///
    /// # Errors
    /// The first failure, as an [`EncoderError`]; the encoder's hold is released either way.
    pub async fn fetch(
        &self,
        url: &str,
        digests: &[ImageDigest],
    ) -> Result<Vec<ImageEmbeds>, EncoderError> {
        if digests.is_empty() {
            return Ok(Vec::new());
        }
        if digests.len() > MAX_HOLD_IMAGES {
            return Err(EncoderError::BadRequest(format!(
                "{} images, more than the {MAX_HOLD_IMAGES} one hold takes",
                digests.len()
            )));
        }
        let started = std::time::Instant::now();
        let result = self.fetch_once(url, digests).await;
        let label = match &result {
            Ok(_) => "ok",
            Err(e) => {
                if e.breaks_session() || matches!(e, EncoderError::Mismatch { .. }) {
                    self.forget(url);
                }
                e.kind()
            }
        };
        metrics::counter!(ENCODER_FETCHES_TOTAL, "result" => label).increment(1);
        metrics::histogram!(ENCODER_FETCH_SECONDS).record(started.elapsed().as_secs_f64());
        result
    }

    /// Forgets the handshake and session with `url`.
    pub fn forget(&self, url: &str) {
        self.infos.remove(url);
        self.sessions.remove(url);
    }

    async fn fetch_once(
        &self,
        url: &str,
        digests: &[ImageDigest],
    ) -> Result<Vec<ImageEmbeds>, EncoderError> {
        let info = self.info(url).await?;
        let session = self.session(url, &info).await?;
        let hold = TransferId::new_random();
        let request = EcRequest::Hold {
            hold,
            initiator: self.engine_id.clone(),
            digests: digests.iter().map(|d| d.0).collect(),
        };
        let held = match self.call(url, &request).await? {
            EcAnswer::Held(h) => h,
            EcAnswer::Failed(e) => return Err(e),
            other => return Err(unexpected("Hold", &other)),
        };
        let read = self.read(&session, &info, &held, digests.len()).await;
        // Released whatever happened: the encoder frees the slots now, not when the lease
        // ends. Its answer says whether the lease held until the read was done.
        let released = self.call(url, &EcRequest::Release(hold)).await;
        let bytes = read?;
        match released? {
            EcAnswer::Released { was_held: true } => {}
            EcAnswer::Released { was_held: false } => return Err(EncoderError::LeaseExpired(hold)),
            EcAnswer::Failed(e) => return Err(e),
            other => return Err(unexpected("Release", &other)),
        }
        metrics::counter!(ENCODER_BYTES_FETCHED_TOTAL).increment(bytes.len() as u64);
        let (rows, width) = (info.rows as usize, info.width as usize);
        let slot = info.slot_bytes as usize;
        Ok(digests
            .iter()
            .enumerate()
            .map(|(i, d)| ImageEmbeds {
                digest: *d,
                rows,
                width,
                data: bytes[i * slot..(i + 1) * slot]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            })
            .collect())
    }

    /// Reads a hold's slots into a scratch region; checks every offset first.
    async fn read(
        &self,
        session: &Session,
        info: &EncoderInfo,
        held: &HeldImages,
        n: usize,
    ) -> Result<Vec<u8>, EncoderError> {
        let slot = info.slot_bytes;
        if held.offsets.len() != n {
            return Err(EncoderError::Protocol(format!(
                "asked to hold {n} images, the encoder held {}",
                held.offsets.len()
            )));
        }
        if let Some(o) = held
            .offsets
            .iter()
            .find(|&&o| o % slot != 0 || o.checked_add(slot).is_none_or(|e| e > info.region_bytes))
        {
            return Err(EncoderError::Protocol(format!(
                "hold offset {o} is not a slot of the {}-byte region",
                info.region_bytes
            )));
        }
        let scratch = self.take_scratch(n * slot as usize)?;
        let ops: Vec<TransferOp> = held
            .offsets
            .iter()
            .enumerate()
            .map(|(i, &o)| TransferOp::read(scratch.id(), i as u64 * slot, info.region, o, slot))
            .collect();
        let fence = Security::of(self.engine.backend())
            .fenced()
            .then(|| fence_id(held.hold));
        let submit = || match fence {
            Some(f) => session.submit_fenced(f, &ops),
            None => session.submit(&ops),
        };
        let batch = match submit() {
            // A session's view may predate the hold's scope: refresh once.
            Err(TransportError::UnknownRegion {
                side: Side::Remote, ..
            }) => {
                tokio::time::timeout(self.timeout, session.refresh_regions())
                    .await
                    .map_err(|_| {
                        EncoderError::timeout("refreshing the encoder's regions", self.timeout)
                    })?
                    .map_err(|e| EncoderError::transfer(&e))?;
                submit().map_err(|e| EncoderError::transfer(&e))?
            }
            r => r.map_err(|e| EncoderError::transfer(&e))?,
        };
        batch.wait(self.timeout).await.map_err(|e| match e {
            TransportError::Fenced { .. } => EncoderError::LeaseExpired(held.hold),
            e => EncoderError::transfer(&e),
        })?;
        let bytes = scratch
            .read_at(0, n * slot as usize)
            .map_err(|e| EncoderError::transfer(&e))?;
        self.keep_scratch(scratch);
        Ok(bytes)
    }

    /// The handshake with `url`, cached; checked against what we need.
    async fn info(&self, url: &str) -> Result<EncoderInfo, EncoderError> {
        if let Some(i) = self.infos.get(url) {
            return Ok(i.clone());
        }
        let info = match self.call(url, &EcRequest::Info).await? {
            EcAnswer::Info(i) => i,
            EcAnswer::Failed(e) => return Err(e),
            other => return Err(unexpected("Info", &other)),
        };
        let e = &self.expect;
        let mismatch = |reason: String| EncoderError::Mismatch {
            encoder: url.to_string(),
            reason,
        };
        if info.version != EC_VERSION {
            return Err(mismatch(format!(
                "it speaks encoder protocol {}, this instance {EC_VERSION}",
                info.version
            )));
        }
        if info.model != e.model {
            return Err(mismatch(format!(
                "it serves `{}`, this instance `{}`",
                info.model, e.model
            )));
        }
        if info.preprocessing != e.preprocessing {
            return Err(mismatch(format!(
                "its image preprocessing is `{}`, ours `{}`",
                info.preprocessing, e.preprocessing
            )));
        }
        if (info.rows as usize, info.width as usize) != (e.rows, e.width)
            || info.slot_bytes != (e.rows * e.width * 4) as u64
            || info.region_bytes < info.slot_bytes
        {
            return Err(mismatch(format!(
                "its images are {}×{} rows in {}-byte slots of a {}-byte region, ours {}×{}",
                info.rows, info.width, info.slot_bytes, info.region_bytes, e.rows, e.width
            )));
        }
        let ours = self.engine.backend().to_string();
        if info.backend != ours {
            return Err(mismatch(format!(
                "its transfer backend is {}, ours {ours}",
                info.backend
            )));
        }
        self.infos.insert(url.to_string(), info.clone());
        Ok(info)
    }

    /// A read session to the encoder's engine, cached while it lives.
    async fn session(&self, url: &str, info: &EncoderInfo) -> Result<Arc<Session>, EncoderError> {
        if let Some(s) = self.sessions.get(url).filter(|s| s.is_alive()) {
            return Ok(s.clone());
        }
        let connect = async {
            if Security::of(self.engine.backend()) == Security::None {
                return self
                    .engine
                    .connect(&info.transfer_addr)
                    .await
                    .map_err(|e| EncoderError::transfer(&e));
            }
            let request = EcRequest::OpenSession {
                initiator: self.engine_id.clone(),
                fresh: true,
            };
            let offer = match self.call(url, &request).await? {
                EcAnswer::Session(o) => o,
                EcAnswer::Failed(e) => return Err(e),
                other => return Err(unexpected("OpenSession", &other)),
            };
            let creds = SessionCredentials {
                key: SessionKey::from_bytes(offer.key),
            };
            self.engine
                .connect_with(&offer.transfer_addr, creds)
                .await
                .map_err(|e| EncoderError::transfer(&e))
        };
        let session = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| {
                EncoderError::timeout(format!("connecting to encoder {url}"), self.timeout)
            })??;
        if let Some(node) = session.peer_node() {
            if node != info.engine_id {
                return Err(EncoderError::Unreachable {
                    encoder: url.to_string(),
                    reason: format!(
                        "the transfer engine there is node `{node}`, not `{}`",
                        info.engine_id
                    ),
                });
            }
        }
        let session = Arc::new(session);
        self.sessions.insert(url.to_string(), session.clone());
        Ok(session)
    }

    async fn call(&self, url: &str, request: &EcRequest) -> Result<EcAnswer, EncoderError> {
        let body = encode_request(request)?;
        let answer = self
            .peers
            .exchange(
                url,
                super::protocol::EC_TOPIC,
                ("/v1/ec/peer", EC_CONTENT_TYPE),
                body,
                self.timeout,
            )
            .await
            .map_err(|e| match e {
                HandoffError::Timeout { what, secs } => EncoderError::Timeout { what, secs },
                e => EncoderError::Unreachable {
                    encoder: url.to_string(),
                    reason: e.to_string(),
                },
            })?;
        if answer.len() > MAX_FRAME_BYTES {
            return Err(EncoderError::Protocol(format!(
                "{url} answered more than {MAX_FRAME_BYTES} bytes"
            )));
        }
        decode_answer(&answer)
    }
}

fn unexpected(asked: &str, answer: &EcAnswer) -> EncoderError {
    EncoderError::Protocol(format!(
        "the encoder answered {asked} with {}",
        answer.name()
    ))
}
