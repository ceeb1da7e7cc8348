//! [`PeerService`]: what an instance answers to the peer protocol, whichever carrier brought
//! the request (the control plane's [`PEER_TOPIC`](super::protocol::PEER_TOPIC), or
//! `POST /v1/kv/peer`).
//!
//! The prefill side of a hand-off reads as four steps: [`validate_prefill`] (pure: prompt,
//! sampling, a push target's layout and destination blocks), admission (the instance's
//! concurrency bound), the prompt's run through the Scheduler (behind [`PrefillHost`]), and —
//! for a push — waiting until the KvSender's last write ended before answering, because the
//! decode side frees its destination blocks when it gets the answer. A request whose handler
//! ends early (the decode side hung up, a timeout, the instance stops) is cleaned up by a
//! guard: its push is cancelled and its prefill aborted or its held blocks freed.
//!
//! The service knows the Scheduler only through [`PrefillHost`], implemented by the
//! Scheduler's handle: the hand-off module does not depend on the scheduler module.

use super::context::KvContext;
use super::plan::validate_peer;
use super::protocol::{
    unix_now_us, HandoffError, HeldKv, KvPeerInfo, PeerAnswer, PeerRequest, PrefillAnswer,
    PrefillMode, PrefillRequest, SessionOffer,
};
use super::push::PushTarget;
use super::sender::KvSenderHandle;
use super::session::block_grants;
use pdserve_gpu::sampling::SamplingParams;
use pdserve_runtime::ids::TransferId;
use pdserve_transport::{Access, FenceScope};
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

use super::aborts::RecentAborts;
pub use super::aborts::ABORT_MEMORY;

/// A prompt to run for a remote decode instance.
#[derive(Clone, Debug)]
pub struct PrefillJob {
    /// The hand-off.
    pub transfer: TransferId,
    /// The prompt.
    pub prompt: Vec<u32>,
    /// Sampling of T0 (`max_tokens` 1).
    pub params: SamplingParams,
    /// Whether each chunk's KV is pushed layer by layer as it is computed.
    pub push: bool,
    /// The prompt's images (taken from an encode instance), in prompt order.
    pub images: Vec<crate::scheduler::PromptImage>,
}

/// A prompt that ran: T0 and the blocks held for the transfer.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillDone {
    /// T0.
    pub first_token: u32,
    /// T0's logprobs, when the job's sampling asked for them.
    pub first_logprobs: Option<pdserve_gpu::sampling::TokenLogprobs>,
    /// The prompt's blocks, held under the transfer's lease.
    pub held_blocks: Vec<u32>,
    /// Leading prompt tokens taken from this instance's prefix cache.
    pub cached_tokens: usize,
}

/// What the service needs from the instance's Scheduler.
pub trait PrefillHost: Send + Sync + 'static {
    /// Runs `job`'s prompt, samples T0 and keeps its blocks held under the transfer's lease.
    /// Dropping the future before it resolves aborts the request.
    fn prefill(
        &self,
        job: PrefillJob,
    ) -> impl Future<Output = Result<PrefillDone, HandoffError>> + Send;
    /// Renews the leases of held transfers; resolves to those no longer held.
    fn renew(
        &self,
        transfers: Vec<TransferId>,
    ) -> impl Future<Output = Result<Vec<TransferId>, HandoffError>> + Send;
    /// The blocks held for a transfer while its lease lives.
    fn held_blocks(
        &self,
        transfer: TransferId,
    ) -> impl Future<Output = Result<Option<Vec<u32>>, HandoffError>> + Send;
    /// Frees a transfer's held blocks; resolves to whether they were still held.
    fn release(
        &self,
        transfer: TransferId,
    ) -> impl Future<Output = Result<bool, HandoffError>> + Send;
    /// Aborts the request computing a transfer, or frees its held blocks; resolves to
    /// whether anything was found.
    fn abort_transfer(
        &self,
        transfer: TransferId,
    ) -> impl Future<Output = Result<bool, HandoffError>> + Send;
    /// [`PrefillHost::abort_transfer`] without waiting (from a drop guard).
    fn abort_transfer_now(&self, transfer: TransferId);
}

/// The limits a prompt is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLimits {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_model_len: usize,
}

/// A Prefill request that passed [`validate_prefill`].
#[derive(Debug)]
pub struct ValidPrefill {
    /// The job for the Scheduler.
    pub job: PrefillJob,
    /// Where a push writes.
    pub target: Option<PushTarget>,
}

/// Checks a Prefill request before anything runs: a non-empty prompt of tokens inside the
/// vocabulary that fits the context with T0, valid sampling, and for a push a target whose
/// layout matches `ours` (the handshake) with exactly the destination blocks the prompt needs,
/// each inside the target's pool.
///
/// # Errors
/// [`HandoffError::BadRequest`], [`HandoffError::InvalidBlocks`], or the handshake's
/// [`HandoffError::Incompatible`] / [`HandoffError::LayoutMismatch`].
pub fn validate_prefill(
    req: PrefillRequest,
    limits: PromptLimits,
    ours: &KvPeerInfo,
    block_size: usize,
) -> Result<ValidPrefill, HandoffError> {
    let bad = |m: String| HandoffError::BadRequest(m);
    let prompt = req.prompt;
    if prompt.is_empty() {
        return Err(bad("the prompt is empty".into()));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary of {}",
            limits.vocab_size
        )));
    }
    if prompt.len() + 1 > limits.max_model_len {
        return Err(bad(format!(
            "the prompt of {} tokens and its first token exceed the context of {}",
            prompt.len(),
            limits.max_model_len
        )));
    }
    let mut params = req.sampling;
    params.max_tokens = 1;
    // Prompt logprobs are computed where the prompt's answer is made (the decode instance
    // prefills such requests itself): none here.
    params.prompt_logprobs = None;
    params
        .validate(limits.vocab_size)
        .map_err(|e| bad(e.to_string()))?;
    let total_blocks = prompt.len().div_ceil(block_size);
    let skip = req.cached_blocks as usize;
    if skip >= total_blocks {
        return Err(HandoffError::InvalidBlocks(format!(
            "the decode instance claims {skip} cached blocks of a {total_blocks}-block prompt: at least the last block moves"
        )));
    }
    let target = match req.mode {
        PrefillMode::Pull => None,
        PrefillMode::Push {
            peer,
            block_ids,
            session,
        } => {
            validate_peer(ours, &peer)?;
            let n = total_blocks - skip;
            if block_ids.len() != n {
                return Err(HandoffError::InvalidBlocks(format!(
                    "{} tokens ({skip} blocks cached) need {n} destination blocks, got {}",
                    prompt.len(),
                    block_ids.len()
                )));
            }
            let pool = peer.ranks[0].layout.num_blocks;
            if let Some(b) = block_ids.iter().find(|&&b| b as usize >= pool) {
                return Err(HandoffError::InvalidBlocks(format!(
                    "destination block {b} is outside the peer's pool of {pool}"
                )));
            }
            let mut seen = std::collections::HashSet::with_capacity(block_ids.len());
            if let Some(b) = block_ids.iter().find(|&&b| !seen.insert(b)) {
                return Err(HandoffError::InvalidBlocks(format!(
                    "destination block {b} is named twice"
                )));
            }
            Some(PushTarget {
                transfer: req.transfer,
                peer,
                blocks: block_ids,
                skip_blocks: skip,
                prompt_len: prompt.len(),
                session,
            })
        }
    };
    Ok(ValidPrefill {
        job: PrefillJob {
            transfer: req.transfer,
            push: target.is_some(),
            prompt,
            params,
            images: Vec::new(),
        },
        target,
    })
}

/// Answers the peer protocol for one instance.
pub struct PeerService<H> {
    kv: Arc<KvContext>,
    host: H,
    sender: Option<KvSenderHandle>,
    admission: Arc<Semaphore>,
    limits: PromptLimits,
    aborted: Mutex<RecentAborts>,
    reads: Mutex<HashMap<TransferId, HeldRead>>,
    images: Option<Arc<crate::encode::ImageResolver>>,
}

/// The read scope a reader opened on a pull hand-off's held blocks: fenced (dropped) when the
/// blocks are released, aborted or their lease ends, so that no read of the hand-off reaches
/// them once they may be reused.
struct HeldRead {
    // Held for its drop: dropping the scope fences it.
    _scope: Option<FenceScope>,
    until: Instant,
}

impl<H: PrefillHost> PeerService<H> {
    /// The service of an instance: its hand-off context, its Scheduler, its KvSender, the
    /// admission bound it shares with its HTTP API, and its prompt limits.
    pub fn new(
        kv: Arc<KvContext>,
        host: H,
        sender: Option<KvSenderHandle>,
        admission: Arc<Semaphore>,
        limits: PromptLimits,
    ) -> Self {
        Self {
            kv,
            host,
            sender,
            admission,
            limits,
            aborted: Mutex::new(RecentAborts::default()),
            reads: Mutex::new(HashMap::new()),
            images: None,
        }
    }

    /// Takes prompts with images ([`PeerRequest::PrefillImages`]) through `resolver`.
    #[must_use]
    pub fn with_images(mut self, resolver: Option<Arc<crate::encode::ImageResolver>>) -> Self {
        self.images = resolver;
        self
    }

    /// Fences the read scopes whose lease ended every `interval` (an eighth of the lease is
    /// what the instance uses: a scope's deadline is 7/8 of the lease after its last renewal,
    /// so it is fenced before the Scheduler frees and reuses its blocks), until the instance
    /// starts to stop or the service is dropped.
    pub fn expire_reads_every(self: &Arc<Self>, interval: Duration) {
        let service = Arc::downgrade(self);
        let stop = self.kv.background.clone();
        self.kv.tasks.spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = stop.cancelled() => return,
                }
                match service.upgrade() {
                    Some(s) => s.expire_reads(Instant::now()),
                    None => return,
                }
            }
        });
    }

    /// How long a read scope stays open after its opening or last renewal: 7/8 of the lease
    /// (the Scheduler frees the blocks at the full lease).
    fn read_deadline(&self) -> Instant {
        Instant::now() + self.kv.settings.lease * 7 / 8
    }

    /// The hand-off context.
    pub fn kv(&self) -> &Arc<KvContext> {
        &self.kv
    }

    /// Answers one request (never fails: a failure is [`PeerAnswer::Failed`]) from `caller`.
    pub async fn handle(&self, request: PeerRequest, caller: Caller<'_>) -> PeerAnswer {
        let name = request.name();
        self.expire_reads(Instant::now());
        let answer = match request {
            PeerRequest::Info => Ok(PeerAnswer::Info(self.kv.info())),
            PeerRequest::Prefill(req) => self
                .prefill(req, caller, Vec::new())
                .await
                .map(PeerAnswer::Prefilled),
            PeerRequest::PrefillImages(p) => self
                .prefill_images(*p, caller)
                .await
                .map(PeerAnswer::Prefilled),
            PeerRequest::Renew(ids) => self.renew(ids).await,
            PeerRequest::Release(t) => {
                self.end_read(t);
                self.host
                    .release(t)
                    .await
                    .map(|was_held| PeerAnswer::Released { was_held })
            }
            PeerRequest::Abort(t) => self
                .abort(t)
                .await
                .map(|found| PeerAnswer::Aborted { found }),
            PeerRequest::OpenSession { initiator, fresh } => self
                .open_session(&initiator, fresh, caller.node)
                .map(PeerAnswer::Session),
            PeerRequest::OpenRead {
                transfer,
                initiator,
            } => self
                .open_read(transfer, &initiator, caller.node)
                .await
                .map(|()| PeerAnswer::ReadOpened),
            PeerRequest::Placement(ask) => {
                super::device::answer_placement(&self.kv, *ask, caller.node)
                    .map(|p| PeerAnswer::Placement(Box::new(p)))
            }
        };
        answer.unwrap_or_else(|e| {
            tracing::debug!(request = name, kind = e.kind(), error = %e, "peer request failed");
            PeerAnswer::Failed(e)
        })
    }

    async fn renew(&self, ids: Vec<TransferId>) -> Result<PeerAnswer, HandoffError> {
        // At most MAX_RENEW_IDS (checked on decode); a set, so the loop under the lock is
        // linear however the peer orders or repeats them.
        let unknown = self.host.renew(ids.clone()).await?;
        let gone: std::collections::HashSet<TransferId> = unknown.iter().copied().collect();
        let until = self.read_deadline();
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        for t in &ids {
            if gone.contains(t) {
                reads.remove(t);
            } else if let Some(r) = reads.get_mut(t) {
                r.until = until;
            }
        }
        Ok(PeerAnswer::Renewed { unknown })
    }

    /// Grants `initiator` a read session to our KV memory (the caller must be that node when
    /// the carrier says who it is).
    fn open_session(
        &self,
        initiator: &str,
        fresh: bool,
        caller: Option<&str>,
    ) -> Result<SessionOffer, HandoffError> {
        check_caller(initiator, caller)?;
        let whole: Vec<u64> = self.kv.memory().1.into_iter().flatten().collect();
        let grant = self
            .kv
            .grants
            .for_peer(initiator, None, fresh, &whole, Access::Read)?;
        Ok(SessionOffer::from(grant.offer()))
    }

    /// Opens the read scope of `transfer`'s held blocks (as the Scheduler holds them: never
    /// ids the reader names) on `initiator`'s session.
    async fn open_read(
        &self,
        transfer: TransferId,
        initiator: &str,
        caller: Option<&str>,
    ) -> Result<(), HandoffError> {
        check_caller(initiator, caller)?;
        let grant = self.kv.grants.current(initiator).ok_or_else(|| {
            HandoffError::NotSupported(format!(
                "{initiator} has no transfer session here: open one first"
            ))
        })?;
        // Nothing held: the lease ran out (or the hand-off never held anything here).
        let blocks = self
            .host
            .held_blocks(transfer)
            .await?
            .ok_or(HandoffError::LeaseExpired(transfer))?;
        let (layouts, regions) = self.kv.memory();
        let ranges = block_grants(&layouts, &regions, &blocks, Access::Read);
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(e) = reads.entry(transfer) {
            let scope = grant.scope(self.kv.security(), transfer, &ranges)?;
            e.insert(HeldRead {
                _scope: scope,
                until: self.read_deadline(),
            });
        }
        Ok(())
    }

    /// Fences the read scope of `transfer` (its blocks are about to be freed).
    fn end_read(&self, transfer: TransferId) {
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&transfer);
    }

    /// Fences the read scopes whose lease ended (the Scheduler frees their blocks).
    fn expire_reads(&self, now: Instant) {
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, r| r.until > now);
    }

    fn recently_aborted(&self, transfer: TransferId) -> bool {
        self.aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(transfer, Instant::now())
    }

    /// A prompt with images: the references checked against the prompt, the embeddings
    /// taken from our encoder cache or the encode instance named, then as a text prompt.
    async fn prefill_images(
        &self,
        p: super::protocol::PrefillWithImages,
        caller: Caller<'_>,
    ) -> Result<PrefillAnswer, HandoffError> {
        let resolver = self.images.as_ref().ok_or_else(|| {
            HandoffError::NotSupported(
                "this instance serves a text-only model (or has no transfer engine to take image embeddings with)".into(),
            )
        })?;
        if self.recently_aborted(p.prefill.transfer) {
            return Err(HandoffError::AlreadyAborted(p.prefill.transfer));
        }
        resolver.check_refs(&p.prefill.prompt, &p.images)?;
        let digests: Vec<pdserve_gpu::vision::ImageDigest> = p
            .images
            .iter()
            .map(|r| pdserve_gpu::vision::ImageDigest(r.digest))
            .collect();
        let embeds = resolver
            .resolve(&p.encoder_url, &digests)
            .await
            .map_err(|e| HandoffError::PrefillFailed {
                kind: "encoder_failed".into(),
                message: format!("image embeddings from encoder {}: {e}", p.encoder_url),
            })?;
        let images = crate::encode::ImageResolver::place(&p.images, embeds);
        self.prefill(p.prefill, caller, images).await
    }

    async fn prefill(
        &self,
        req: PrefillRequest,
        caller: Caller<'_>,
        images: Vec<crate::scheduler::PromptImage>,
    ) -> Result<PrefillAnswer, HandoffError> {
        let transfer = req.transfer;
        if self.recently_aborted(transfer) {
            return Err(HandoffError::AlreadyAborted(transfer));
        }
        let mut valid = validate_prefill(
            req,
            self.limits,
            &self.kv.info(),
            self.kv.settings.block_size,
        )?;
        valid.job.images = images;
        if let Some(target) = &valid.target {
            check_push_destination(target, caller)?;
        }
        let _permit = self
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|e| match e {
                tokio::sync::TryAcquireError::Closed => {
                    HandoffError::Interrupted("the prefill instance is shutting down".into())
                }
                tokio::sync::TryAcquireError::NoPermits => {
                    HandoffError::Overloaded("every request slot is taken".into())
                }
            })?;
        let bound = self.kv.bounds().transfer;
        let pushed = match valid.target {
            None => None,
            Some(target) => {
                let sender = self.sender.clone().ok_or_else(|| {
                    HandoffError::NotSupported("this instance has no KV sender".into())
                })?;
                let session = self
                    .kv
                    .peers
                    .session_with(
                        self.kv.registry.engine(),
                        &target.peer,
                        target.session.as_ref(),
                    )
                    .await?;
                let (tx, rx) = tokio::sync::oneshot::channel();
                sender.open(Arc::new(target), session, tx)?;
                Some((sender, rx))
            }
        };
        tracing::info!(%transfer, push = pushed.is_some(), prompt_tokens = valid.job.prompt.len(), "prefill for a remote decode");
        let mut guard = HandoffGuard {
            transfer,
            service: self,
            settled: false,
        };
        let prefill_bound = self.kv.bounds().prefill;
        let mut compute = Box::pin(tokio::time::timeout(
            prefill_bound,
            self.host.prefill(valid.job),
        ));
        let timed_out = |_| Err(HandoffError::timeout("the prompt's prefill", prefill_bound));
        // A push that ends before the prompt does has failed (its last write follows the last
        // layer): the prompt is not worth finishing, and dropping its future aborts it.
        let mut early_outcome = None;
        let mut pushed = pushed;
        let done = match pushed.as_mut() {
            None => (&mut compute).await.unwrap_or_else(timed_out),
            Some((_, outcome)) => tokio::select! {
                d = &mut compute => d.unwrap_or_else(timed_out),
                o = outcome => match o {
                    Ok(Ok(())) => {
                        early_outcome = Some(Ok(Ok(())));
                        (&mut compute).await.unwrap_or_else(timed_out)
                    }
                    Ok(Err(e)) => {
                        tracing::info!(%transfer, error = %e, "the push failed: prefill abandoned");
                        early_outcome = Some(Ok(Err(e.clone())));
                        Err(e)
                    }
                    Err(closed) => {
                        early_outcome = Some(Err(closed));
                        Err(HandoffError::Interrupted(
                            "the KV sender failed during the hand-off".into(),
                        ))
                    }
                },
            },
        };
        // Finished, or abandoned: an abandoned prompt is aborted here, not when we return.
        drop(compute);
        let computed_at_unix_us = unix_now_us();
        let Some((sender, pushed)) = pushed else {
            // Pull: the blocks stay held under the lease until the decode side releases them.
            let done = done?;
            guard.settled = true;
            return Ok(PrefillAnswer {
                transfer,
                first_token: done.first_token,
                first_logprobs: done.first_logprobs,
                held: Some(HeldKv {
                    block_ids: done.held_blocks,
                    lease_ms: self.kv.settings.lease.as_millis() as u64,
                }),
                computed_at_unix_us,
                cached_tokens: saturating_u32(done.cached_tokens),
            });
        };
        if let Err(e) = &done {
            sender.cancel(transfer, e.clone(), None);
        }
        // Wait for the last write (or, after a failure, for the writes in flight to drain):
        // the decode side frees its blocks when it gets this answer. Every write was
        // submitted before the prompt's last layer, and each ends within the transfer bound.
        let outcome = match early_outcome {
            Some(o) => Ok(o),
            None => tokio::time::timeout(bound, pushed).await,
        };
        let written = match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                // The KvSender (or the Aggregator) failed with the hand-off open: nobody can
                // say whether its writes drained; each ends within the transfer bound of that
                // failure.
                let until = self
                    .kv
                    .orphan_writes_deadline()
                    .unwrap_or_else(|| Instant::now() + bound);
                tokio::time::sleep_until(until.into()).await;
                Err(HandoffError::Interrupted(
                    "the KV sender failed during the hand-off".into(),
                ))
            }
            Err(_) => Err(HandoffError::timeout("the KV writes", bound)),
        };
        // A push holds the blocks only until the writes are done.
        let _ = self.host.release(transfer).await;
        guard.settled = written.is_ok();
        let done = done?;
        written?;
        Ok(PrefillAnswer {
            transfer,
            first_token: done.first_token,
            first_logprobs: done.first_logprobs,
            held: None,
            computed_at_unix_us,
            cached_tokens: saturating_u32(done.cached_tokens),
        })
    }

    async fn abort(&self, transfer: TransferId) -> Result<bool, HandoffError> {
        {
            self.aborted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(transfer, Instant::now());
        }
        self.end_read(transfer);
        let found = self.host.abort_transfer(transfer).await?;
        // Answer only once no write of this hand-off can land any more: the decode side frees
        // its destination blocks when it gets this answer.
        if let Some(sender) = &self.sender {
            let (tx, rx) = tokio::sync::oneshot::channel();
            sender.cancel(transfer, HandoffError::Aborted, Some(tx));
            let bound = self.kv.bounds().transfer;
            if !matches!(tokio::time::timeout(bound, rx).await, Ok(Ok(()))) {
                return Err(HandoffError::timeout(
                    format!("draining the writes of transfer {transfer}"),
                    bound,
                ));
            }
        }
        Ok(found)
    }
}

/// Frees held blocks and stops pushes of a hand-off whose handler ends early (the decode
/// side hung up, a timeout): nothing waits for a release that will not come.
struct HandoffGuard<'a, H: PrefillHost> {
    transfer: TransferId,
    service: &'a PeerService<H>,
    settled: bool,
}

impl<H: PrefillHost> Drop for HandoffGuard<'_, H> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if let Some(sender) = &self.service.sender {
            sender.cancel(
                self.transfer,
                HandoffError::PeerGone {
                    peer: "the decode instance".into(),
                    reason: "it went away".into(),
                },
                None,
            );
        }
        self.service.end_read(self.transfer);
        self.service.host.abort_transfer_now(self.transfer);
    }
}

/// Who sent a peer request, as its carrier knows it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Caller<'a> {
    /// The node the carrier authenticated (the control plane's member certificate); `None`
    /// over HTTP, where the cluster's API key (or a loopback address) let the call in.
    pub node: Option<&'a str>,
    /// The address the request came from (`None`: in process).
    pub ip: Option<IpAddr>,
}

/// A push writes where the request says: over a carrier that did not authenticate a member
/// (HTTP), the destination's transfer address must be on the host the request came from, so
/// a caller cannot aim this instance's writes at a third host. (A member authenticated on the
/// control plane is trusted with its own addresses, which may be on another network of its
/// host, e.g. an RDMA fabric.)
fn check_push_destination(target: &PushTarget, caller: Caller<'_>) -> Result<(), HandoffError> {
    let (None, Some(from)) = (caller.node, caller.ip) else {
        return Ok(());
    };
    if target.peer.backend == "local" {
        // In-process engines, named rather than addressed.
        return Ok(());
    }
    let from = from.to_canonical();
    let named = std::iter::once(&target.peer.transfer_addr)
        .chain(target.session.as_ref().map(|s| &s.transfer_addr));
    for addr in named {
        let ip = addr
            .parse::<std::net::SocketAddr>()
            .map_err(|_| {
                HandoffError::BadRequest(format!("the push destination `{addr}` is not an IP:port"))
            })?
            .ip()
            .to_canonical();
        if ip != from && !(ip.is_loopback() && from.is_loopback()) {
            return Err(HandoffError::BadRequest(format!(
                "the push destination {addr} is not on the host the request came from ({from})"
            )));
        }
    }
    Ok(())
}

/// On a carrier that authenticated the caller, an initiator must be the caller itself.
fn check_caller(initiator: &str, caller: Option<&str>) -> Result<(), HandoffError> {
    match caller {
        Some(c) if c != initiator => Err(HandoffError::BadRequest(format!(
            "node `{c}` cannot open a transfer session for `{initiator}`"
        ))),
        _ => Ok(()),
    }
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::protocol::{compat_hash, RankKv};
    use pdserve_gpu::kv::{KvDtype, KvLayout};

    fn info(blocks: usize, block_size: usize) -> KvPeerInfo {
        KvPeerInfo {
            engine_id: "x".into(),
            compat_key: "k".into(),
            compat_hash: compat_hash("k"),
            transfer_addr: "a".into(),
            backend: "local".into(),
            num_kv_heads: 2,
            ranks: vec![RankKv {
                heads: (0, 2),
                layout: KvLayout {
                    num_layers: 2,
                    num_blocks: blocks,
                    block_size,
                    num_kv_heads: 2,
                    head_dim: 4,
                    dtype: KvDtype::F32,
                },
                regions: vec![1, 2],
            }],
        }
    }

    fn req(prompt: Vec<u32>, mode: PrefillMode) -> PrefillRequest {
        PrefillRequest {
            transfer: TransferId(1),
            prompt,
            sampling: SamplingParams::greedy(50),
            mode,
            cached_blocks: 0,
        }
    }

    const LIMITS: PromptLimits = PromptLimits {
        vocab_size: 100,
        max_model_len: 64,
    };

    #[test]
    fn a_valid_pull_becomes_a_one_token_job() {
        let v = validate_prefill(
            req(vec![1, 2, 3], PrefillMode::Pull),
            LIMITS,
            &info(8, 4),
            4,
        )
        .unwrap();
        assert_eq!(v.job.params.max_tokens, 1);
        assert!(!v.job.push && v.target.is_none());
    }

    #[test]
    fn bad_prompts_and_forged_destinations_are_refused_by_name() {
        let push = |ids: Vec<u32>, peer: KvPeerInfo| PrefillMode::Push {
            peer,
            block_ids: ids,
            session: None,
        };
        let cases: Vec<(PrefillRequest, &str)> = vec![
            (req(vec![], PrefillMode::Pull), "empty"),
            (
                req(vec![1, 100], PrefillMode::Pull),
                "outside the vocabulary",
            ),
            (req(vec![1; 64], PrefillMode::Pull), "exceed the context"),
            (
                req(vec![1; 5], push(vec![0], info(8, 4))),
                "need 2 destination blocks",
            ),
            (
                req(vec![1; 5], push(vec![0, 8], info(8, 4))),
                "outside the peer's pool",
            ),
            (req(vec![1; 5], push(vec![3, 3], info(8, 4))), "named twice"),
            (
                req(vec![1; 5], push(vec![0, 1], info(8, 8))),
                "blocks of 8 tokens",
            ),
        ];
        for (r, needle) in cases {
            let e = validate_prefill(r, LIMITS, &info(8, 4), 4).unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
        let mut hot = req(vec![1, 2], PrefillMode::Pull);
        hot.sampling.temperature = -1.0;
        assert!(matches!(
            validate_prefill(hot, LIMITS, &info(8, 4), 4),
            Err(HandoffError::BadRequest(_))
        ));
    }
}
