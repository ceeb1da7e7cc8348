//! The KvReceiver actor: the decode side of KV hand-offs.
//!
//! A request that arrives with `kv_transfer_params.do_remote_prefill` gets its destination
//! blocks from the Scheduler (state `WaitingForRemoteKv`) and a [`KvReceiverMsg::Fetch`] here.
//! For each, the actor starts one driver task (tracked by the instance's [`KvContext`], so an
//! instance stop drains it) that runs a [`PullCore`]: it performs the core's actions — the
//! Prefill call, the reads (one batch per local TP rank, joined by the Aggregator, with the
//! lease renewed meanwhile), the release, the abort — and feeds their outcomes, cancels and
//! time back into it. The Scheduler hears the outcome exactly once through the fetch's
//! [`FetchReply`]; the driver keeps a share of the destination blocks until the core says no
//! byte can land in them any more. The mailbox never waits.
//!
//! Messages: [`KvReceiverMsg`]. Supervised by the `InstanceSupervisor`, which restarts it in
//! place (and moves every rank's hand-off epoch on: reports of the hand-offs the old
//! incarnation planned are stale). Driver tasks and their cancel handles live in the
//! [`KvContext`], not in the actor, so an abort reaches a hand-off whichever incarnation
//! started it.

use super::aggregator::{AggregatorHandle, RankReport};
use super::context::KvContext;
use super::peer::{PeerAddr, RenewGuard};
use super::plan::{check_blocks, plan_pull};
use super::protocol::TransferFailure;
use super::protocol::{
    HandoffError, KvPeerInfo, PeerAnswer, PeerRequest, PrefillAnswer, PrefillMode, PrefillRequest,
    SessionOffer,
};
use super::pull::{Held, Prefilled, PullAction, PullCore, PullEvent, Shape};
use super::session::{block_grants, fence_id, submit_ops, Grant, Security};
use crate::block_manager::BlockAllocation;
use crate::mailbox::{Inbox, Mailbox};
use futures_util::stream::{FuturesUnordered, StreamExt};
use pdserve_gpu::sampling::{SamplingParams, TokenLogprobs};
use pdserve_runtime::ids::{RequestId, TransferId};
use pdserve_runtime::supervision::ActorKind;
use pdserve_transport::{Access, FenceId, FenceScope};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Where a remote request's prompt KV comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum KvSource {
    /// Already computed and held by a prefill instance (vLLM's two-hop flow).
    Held {
        /// The prefill instance.
        peer: PeerAddr,
        /// The hand-off.
        transfer: TransferId,
        /// Its blocks holding the prompt (`remote_block_ids`).
        block_ids: Vec<u32>,
        /// The first token it sampled (T0).
        first_token: u32,
        /// T0's logprobs (`first_token_logprobs`), when the request asked for them (checked
        /// against the vocabulary and the count asked before this is built).
        first_logprobs: Option<TokenLogprobs>,
        /// How long it holds the blocks unless renewed (`kv_lease_ms`), when it said.
        lease: Option<Duration>,
        /// Leading prompt tokens it took from its prefix cache (`cached_tokens`), checked
        /// below the prompt's length before this is built.
        cached_tokens: u32,
    },
    /// To be computed by the prefill instance `peer`, asked by us.
    Drive {
        /// The prefill instance.
        peer: PeerAddr,
        /// The hand-off.
        transfer: TransferId,
        /// The encode instance holding the prompt's images' embeddings (E/P/D), which the
        /// prefill instance takes them from.
        encoder: Option<String>,
    },
}

impl KvSource {
    /// The hand-off id.
    pub fn transfer(&self) -> TransferId {
        match self {
            Self::Held { transfer, .. } | Self::Drive { transfer, .. } => *transfer,
        }
    }

    /// The prefill instance.
    pub fn peer(&self) -> &PeerAddr {
        match self {
            Self::Held { peer, .. } | Self::Drive { peer, .. } => peer,
        }
    }
}

/// How a fetch ended.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchOutcome {
    /// T0, or why the hand-off failed.
    pub result: Result<u32, HandoffError>,
    /// T0's logprobs, computed by the prefill instance, when the request asked for them.
    pub first_logprobs: Option<TokenLogprobs>,
    /// When the prefill instance had the whole prompt computed (µs since the Unix epoch), when
    /// it said.
    pub computed_at_unix_us: Option<u64>,
    /// Leading prompt tokens the prefill instance took from its prefix cache, when it said
    /// (a hand-off it drove; checked below the prompt's length).
    pub prefill_cached_tokens: Option<u32>,
    /// Our blocks the hand-off wrote (after its landing fence), in prompt order: with a
    /// device KV cache they landed in the host mirror and are uploaded before the first
    /// decode step. Empty when it failed.
    pub landed_blocks: Vec<u32>,
}

/// The Scheduler's end of a hand-off: answered exactly once, by the hand-off or, if the
/// request never got that far (the KvReceiver failed with it in its mailbox), by its drop.
pub struct FetchReply(Option<Box<dyn FnOnce(FetchOutcome) + Send>>);

impl FetchReply {
    /// A reply that calls `f` once.
    pub fn new(f: impl FnOnce(FetchOutcome) + Send + 'static) -> Self {
        Self(Some(Box::new(f)))
    }

    fn send(mut self, outcome: FetchOutcome) {
        if let Some(f) = self.0.take() {
            f(outcome);
        }
    }
}

impl Drop for FetchReply {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(FetchOutcome {
                result: Err(HandoffError::Interrupted(
                    "the KV receiver failed before the hand-off started".into(),
                )),
                first_logprobs: None,
                computed_at_unix_us: None,
                prefill_cached_tokens: None,
                landed_blocks: Vec::new(),
            });
        }
    }
}

/// One request's hand-off for the KvReceiver.
pub struct Fetch {
    /// Request.
    pub id: RequestId,
    /// Where it comes from.
    pub source: KvSource,
    /// Our destination blocks (a share, kept until no byte can land any more): the whole
    /// prompt's, the first `cached_blocks` of them from our prefix cache.
    pub blocks: BlockAllocation,
    /// Leading blocks we already hold (prefix cache): only the others move.
    pub cached_blocks: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// The request's sampling (the prefill side samples T0 with it).
    pub params: SamplingParams,
    /// The prompt's images by reference (sent with the prompt when the prefill instance
    /// computes it: it takes their embeddings from the encoder in [`KvSource::Drive`]).
    pub images: Vec<super::protocol::ImageRef>,
    /// Where the outcome goes.
    pub reply: FetchReply,
}

/// Messages of the KvReceiver.
pub enum KvReceiverMsg {
    /// Bring a request's prompt KV into its destination blocks.
    Fetch(Box<Fetch>),
    /// The request was aborted: stop its hand-off (the prefill side is told).
    Abort(RequestId),
    /// A request dropped before its fetch started (its client left while its prefix was
    /// restored from the KV tiers): tell the prefill side to drop the hand-off, as an abort
    /// during the fetch does, so that it frees what it holds for it now, not when the lease
    /// ends.
    Abandon(KvSource),
}

/// The KvReceiver's typed address, for the Scheduler.
#[derive(Clone, Debug)]
pub struct KvReceiverHandle(Mailbox<KvReceiverMsg>);

impl KvReceiverHandle {
    /// The handle of the KvReceiver behind `mailbox`.
    pub fn new(mailbox: Mailbox<KvReceiverMsg>) -> Self {
        Self(mailbox)
    }

    /// Brings a request's prompt KV in. Returns whether the KvReceiver took it (when it is
    /// gone the caller fails the request: nothing else would answer the fetch).
    pub fn fetch(&self, fetch: Box<Fetch>) -> bool {
        self.0
            .tell(ActorKind::KvReceiver, "fetch", KvReceiverMsg::Fetch(fetch))
    }

    /// The request was aborted: stop its hand-off. With the KvReceiver gone, its fetches
    /// died with it and the prefill side's lease frees what it held.
    pub fn abort(&self, id: RequestId) {
        self.0
            .tell(ActorKind::KvReceiver, "abort", KvReceiverMsg::Abort(id));
    }

    /// A request dropped before its fetch started: tell the prefill side to drop the
    /// hand-off (if the KvReceiver is gone, the lease frees it).
    pub fn abandon(&self, source: KvSource) {
        self.0.tell(
            ActorKind::KvReceiver,
            "abandon",
            KvReceiverMsg::Abandon(source),
        );
    }
}

/// The KvReceiver actor (its mailbox count).
#[derive(Debug)]
pub struct KvReceiver(pub Inbox);

/// Its state.
pub struct ReceiverState {
    kv: Arc<KvContext>,
    aggregator: AggregatorHandle,
}

impl Actor for KvReceiver {
    type Msg = KvReceiverMsg;
    type State = ReceiverState;
    type Arguments = (Arc<KvContext>, AggregatorHandle);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (kv, aggregator): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ReceiverState { kv, aggregator })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            KvReceiverMsg::Fetch(fetch) => {
                let cancel = st.kv.track_handoff(fetch.id);
                st.kv.handoff_started();
                let driver = Driver {
                    kv: st.kv.clone(),
                    aggregator: st.aggregator.clone(),
                };
                st.kv.tasks.spawn(driver.run(*fetch, cancel));
            }
            KvReceiverMsg::Abort(id) => st.kv.cancel_handoff(id),
            KvReceiverMsg::Abandon(source) => {
                let kv = st.kv.clone();
                st.kv.tasks.spawn(async move {
                    let (peer, transfer) = (source.peer().clone(), source.transfer());
                    let r = kv
                        .peers
                        .call(&peer, &PeerRequest::Abort(transfer), kv.bounds().transfer)
                        .await;
                    match r {
                        Ok(PeerAnswer::Aborted { .. }) => {
                            tracing::debug!(%transfer, %peer, "abandoned hand-off aborted on the prefill side")
                        }
                        Ok(PeerAnswer::Failed(e)) | Err(e) => {
                            tracing::info!(%transfer, %peer, error = %e, "the prefill instance did not confirm the abort")
                        }
                        Ok(other) => {
                            tracing::info!(%transfer, %peer, answer = other.name(), "the prefill instance answered Abort unexpectedly")
                        }
                    }
                });
            }
        }
        Ok(())
    }
}

/// A call's outcome: the core's event, and with an answered Prefill the answer itself (the
/// driver keeps what the core does not act on: T0's logprobs, timing, cached tokens).
type Call = Pin<Box<dyn Future<Output = (PullEvent, Option<PrefillAnswer>)> + Send>>;

/// A call whose outcome is only the core's event.
fn plain(call: impl Future<Output = PullEvent> + Send + 'static) -> Call {
    Box::pin(async move { (call.await, None) })
}

/// A push's grant to the prefill instance and the fenced scope of its destination blocks,
/// held until the blocks are released.
type WriteScope = Arc<Mutex<Option<(Arc<Grant>, Option<FenceScope>)>>>;

/// How the logprobs a prefill instance sent with T0 differ from what we asked
/// ([`check_first_logprobs`]).
#[derive(Debug, thiserror::Error)]
enum FirstLogprobsError {
    /// Logprobs came, but the request asked for none.
    #[error("the prefill instance sent logprobs nobody asked for")]
    Unasked,
    /// The request asked for logprobs and none came.
    #[error("the prefill instance sent no logprobs for the first token")]
    Missing,
    /// The logprobs are for another token than T0.
    #[error("the first token's logprobs are for token {got}, not {first_token}")]
    OtherToken {
        /// The token they are for.
        got: u32,
        /// T0.
        first_token: u32,
    },
    /// The values themselves are refused.
    #[error("the first token's logprobs: {0}")]
    Invalid(#[from] pdserve_gpu::sampling::LogprobsError),
}

/// Checks the logprobs a prefill instance sent with T0 against what we asked: present
/// exactly when asked, for T0, at most the alternatives asked, ids inside the vocabulary,
/// finite values ≤ 0.
fn check_first_logprobs(
    a: &PrefillAnswer,
    asked: Option<u32>,
    vocab: usize,
) -> Result<(), FirstLogprobsError> {
    match (&a.first_logprobs, asked) {
        (None, None) => Ok(()),
        (Some(_), None) => Err(FirstLogprobsError::Unasked),
        (None, Some(_)) => Err(FirstLogprobsError::Missing),
        (Some(lp), Some(_)) if lp.token != a.first_token => Err(FirstLogprobsError::OtherToken {
            got: lp.token,
            first_token: a.first_token,
        }),
        (Some(lp), Some(n)) => Ok(lp.validate(vocab, n as usize)?),
    }
}

/// Performs one hand-off's [`PullCore`] actions.
/// A prompt's images as a hand-off it drives sends them: by reference, with the encoder.
struct PromptImages {
    refs: Vec<super::protocol::ImageRef>,
    encoder: Option<String>,
}

#[derive(Clone)]
struct Driver {
    kv: Arc<KvContext>,
    aggregator: AggregatorHandle,
}

impl Driver {
    async fn run(self, fetch: Fetch, cancel: CancellationToken) {
        let Fetch {
            id,
            source,
            blocks,
            cached_blocks,
            prompt,
            params,
            images,
            reply,
        } = fetch;
        let transfer = source.transfer();
        let images: Option<Arc<PromptImages>> = (!images.is_empty()).then(|| {
            let encoder = match &source {
                KvSource::Drive { encoder, .. } => encoder.clone(),
                KvSource::Held { .. } => None,
            };
            Arc::new(PromptImages {
                refs: images,
                encoder,
            })
        });
        let peer = source.peer().clone();
        let mode = match &source {
            KvSource::Held { .. } => super::context::TransferMode::Pull,
            KvSource::Drive { .. } => self.kv.settings.mode,
        };
        let mut first_logprobs = None;
        let mut prefill_cached_tokens = None;
        let shape = match source {
            KvSource::Held {
                block_ids,
                first_token,
                first_logprobs: lp,
                lease,
                cached_tokens,
                ..
            } => {
                first_logprobs = lp;
                prefill_cached_tokens = Some(cached_tokens);
                Shape::Held {
                    block_ids,
                    first_token,
                    lease,
                }
            }
            KvSource::Drive { .. } if mode == super::context::TransferMode::Push => {
                Shape::DrivePush
            }
            KvSource::Drive { .. } => Shape::DrivePull,
        };
        let started = Instant::now();
        let (mut core, mut actions) = PullCore::start(transfer, shape, self.kv.bounds(), started);
        let local: Vec<u32> = blocks.blocks().to_vec();
        let mut blocks = Some(blocks);
        let mut reply = Some(reply);
        let mut calls: FuturesUnordered<Call> = FuturesUnordered::new();
        let mut renewing: Option<RenewGuard> = None;
        let write_scope: WriteScope = Arc::default();
        // Set when the blocks were copied device to device (CUDA IPC): nothing landed in the
        // host mirror, so nothing may be uploaded from it (stale bytes over the copied ones).
        let device_read = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut computed_at = None;
        let mut result: Option<Result<(), HandoffError>> = None;
        let mut cancelled = false;
        loop {
            for action in actions.drain(..) {
                match action {
                    PullAction::SendPrefill => calls.push(Box::pin(self.clone().prefill(
                        peer.clone(),
                        transfer,
                        prompt.clone(),
                        params.clone(),
                        local.clone(),
                        cached_blocks,
                        mode,
                        write_scope.clone(),
                        images.clone(),
                    ))),
                    PullAction::Read { block_ids, lease } => {
                        let lease = lease.unwrap_or(self.kv.settings.lease);
                        renewing = Some(self.kv.peers.renew_while_alive(&peer, transfer, lease));
                        calls.push(plain(self.clone().read(
                            peer.clone(),
                            transfer,
                            block_ids,
                            local.clone(),
                            cached_blocks,
                            prompt.len(),
                            device_read.clone(),
                        )));
                    }
                    PullAction::SendRelease => {
                        calls.push(plain(self.clone().release(peer.clone(), transfer)))
                    }
                    PullAction::SendAbort => {
                        calls.push(plain(self.clone().abort(peer.clone(), transfer)))
                    }
                    PullAction::Finish(r) => {
                        self.finished(id, transfer, &r, mode, started);
                        if r.is_ok() {
                            let n = prompt.len().div_ceil(self.kv.settings.block_size);
                            let skipped = cached_blocks.min(n);
                            self.kv.handoff_moved((n - skipped) as u64, skipped as u64);
                        }
                        result = Some(r.as_ref().map(|_| ()).map_err(Clone::clone));
                        if let Err(e) = &r {
                            self.kv.peers.forget(&peer);
                            if e.breaks_session() {
                                // A push's writes may be stuck behind a broken link: the
                                // next push from that peer gets a new key (this one keeps
                                // the old grant until its blocks are released).
                                if let Some((g, _)) = write_scope
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .as_ref()
                                {
                                    self.kv.grants.retire(g.peer());
                                }
                            }
                        }
                        let copied_on_device =
                            device_read.load(std::sync::atomic::Ordering::Acquire);
                        let landed_blocks = if r.is_ok() && !copied_on_device {
                            landed(
                                &local,
                                cached_blocks,
                                prompt.len(),
                                self.kv.settings.block_size,
                            )
                        } else {
                            Vec::new()
                        };
                        if let Some(reply) = reply.take() {
                            reply.send(FetchOutcome {
                                result: r,
                                first_logprobs: first_logprobs.take(),
                                computed_at_unix_us: computed_at,
                                prefill_cached_tokens,
                                landed_blocks,
                            });
                        }
                    }
                    // The destination blocks stay shared until here: no reuse while bytes may
                    // land. Their write scope is fenced first: from here no write lands.
                    PullAction::ReleaseBlocks => {
                        drop(write_scope.lock().unwrap_or_else(|e| e.into_inner()).take());
                        drop(blocks.take());
                    }
                }
            }
            if core.is_done() {
                break;
            }
            let deadline = core.deadline();
            let event = tokio::select! {
                Some((ev, answer)) = calls.next() => {
                    if let Some(a) = answer {
                        computed_at = Some(a.computed_at_unix_us);
                        prefill_cached_tokens = Some(a.cached_tokens);
                        first_logprobs = a.first_logprobs;
                    }
                    Some(ev)
                }
                () = cancel.cancelled(), if !cancelled => {
                    cancelled = true;
                    Some(PullEvent::Cancel)
                }
                () = sleep_until(deadline), if deadline.is_some() => None,
            };
            let now = Instant::now();
            actions = match event {
                Some(ev) => {
                    if matches!(ev, PullEvent::ReadsDone(_) | PullEvent::ReadsRefused(_)) {
                        renewing = None;
                    }
                    core.on(ev, now)
                }
                None => core.tick(now),
            };
        }
        drop(renewing);
        self.kv.untrack_handoff(id);
        self.kv
            .handoff_ended(result.as_ref().map_or(Ok(()), |r| r.as_ref().map(|_| ())));
    }

    fn finished(
        &self,
        id: RequestId,
        transfer: TransferId,
        r: &Result<u32, HandoffError>,
        mode: super::context::TransferMode,
        started: Instant,
    ) {
        use pdserve_runtime::telemetry as m;
        let ms = started.elapsed().as_millis() as u64;
        match r {
            Err(e) => {
                tracing::warn!(request = %id, %transfer, kind = e.kind(), error = %e, "KV hand-off failed");
            }
            Ok(_) => {
                metrics::histogram!(m::KV_TRANSFER_SECONDS, m::LABEL_MODE => mode.as_str())
                    .record(started.elapsed().as_secs_f64());
                tracing::info!(request = %id, %transfer, mode = mode.as_str(), ms, "KV hand-off done");
            }
        }
    }

    /// Grants the prefill instance `theirs` the writes of a push into our `blocks`: its
    /// session key (reused while its session lives) and, where the backend fences, the scope
    /// of exactly those blocks, kept in `scope` until the blocks are released. `None` on
    /// `local` (no keys).
    fn grant_writes(
        &self,
        theirs: &KvPeerInfo,
        transfer: TransferId,
        blocks: &[u32],
        scope: &WriteScope,
    ) -> Result<Option<SessionOffer>, HandoffError> {
        let security = self.kv.security();
        if security == Security::None {
            return Ok(None);
        }
        let (layouts, regions) = self.kv.memory();
        let whole: Vec<u64> = regions.iter().flatten().copied().collect();
        let grant = self.kv.grants.for_peer(
            &theirs.engine_id,
            Some(&theirs.transfer_addr),
            false,
            &whole,
            Access::Write,
        )?;
        let ranges = block_grants(&layouts, &regions, blocks, Access::Write);
        let fence = grant.scope(security, transfer, &ranges)?;
        let offer = SessionOffer::from(grant.offer());
        *scope.lock().unwrap_or_else(|e| e.into_inner()) = Some((grant, fence));
        Ok(Some(offer))
    }

    /// The Prefill call (with the handshake first when pushing: the peer's layout is
    /// validated against ours before it may write).
    #[allow(clippy::too_many_arguments)]
    async fn prefill(
        self,
        peer: PeerAddr,
        transfer: TransferId,
        prompt: Vec<u32>,
        mut sampling: SamplingParams,
        local: Vec<u32>,
        cached_blocks: usize,
        mode: super::context::TransferMode,
        write_scope: WriteScope,
        images: Option<Arc<PromptImages>>,
    ) -> (PullEvent, Option<PrefillAnswer>) {
        sampling.max_tokens = 1;
        let asked = sampling.logprobs;
        let not_sent = |error| {
            let failed = PullEvent::PrefillFailed {
                error,
                answered: true,
            };
            (failed, None)
        };
        let mode = match mode {
            super::context::TransferMode::Pull => PrefillMode::Pull,
            super::context::TransferMode::Push => {
                let ours = self.kv.info();
                let theirs = match self.kv.peers.info(&peer, &ours).await {
                    Ok(t) => t,
                    Err(e) => return not_sent(e),
                };
                let n = prompt.len().div_ceil(self.kv.settings.block_size);
                if local.len() < n || cached_blocks >= n {
                    return not_sent(HandoffError::InvalidBlocks(format!(
                        "{} tokens need {n} destination blocks, the request owns {} ({cached_blocks} cached)",
                        prompt.len(),
                        local.len()
                    )));
                }
                // Only the blocks we lack are written (and granted): cached ones are shared
                // with other requests and never written.
                let dest = &local[cached_blocks..n];
                let session = match self.grant_writes(&theirs, transfer, dest, &write_scope) {
                    Ok(s) => s,
                    Err(e) => return not_sent(e),
                };
                PrefillMode::Push {
                    peer: ours,
                    block_ids: dest.to_vec(),
                    session,
                }
            }
        };
        let prompt_len = prompt.len();
        let prefill = PrefillRequest {
            transfer,
            prompt,
            sampling,
            mode,
            cached_blocks: cached_blocks as u32,
        };
        let request = match images.as_deref() {
            None => PeerRequest::Prefill(prefill),
            Some(PromptImages { encoder: None, .. }) => {
                return not_sent(HandoffError::NotSupported(
                    "a prompt with images is prefilled remotely only with an encode instance holding them (ec_transfer_params.encoder_url)".into(),
                ))
            }
            Some(PromptImages {
                refs,
                encoder: Some(url),
            }) => PeerRequest::PrefillImages(Box::new(super::protocol::PrefillWithImages {
                prefill,
                images: refs.clone(),
                encoder_url: url.clone(),
            })),
        };
        let within = self.kv.bounds().prefill;
        match self.kv.peers.call(&peer, &request, within).await {
            Ok(PeerAnswer::Prefilled(a)) => {
                let vocab = self.kv.settings.model.vocab_size;
                if a.first_token as usize >= vocab {
                    not_sent(HandoffError::Protocol(format!(
                        "the prefill instance answered first token {}, outside the vocabulary",
                        a.first_token
                    )))
                } else if let Err(e) = check_first_logprobs(&a, asked, vocab) {
                    not_sent(HandoffError::Protocol(e.to_string()))
                } else if a.cached_tokens as usize >= prompt_len {
                    // Its last token at least was computed: that is where T0 came from.
                    not_sent(HandoffError::Protocol(format!(
                        "the prefill instance reports {} cached tokens of a {prompt_len}-token prompt",
                        a.cached_tokens
                    )))
                } else if a.transfer != transfer {
                    not_sent(HandoffError::Protocol(format!(
                        "the prefill instance answered for transfer {}, not {transfer}",
                        a.transfer
                    )))
                } else {
                    let prefilled = Prefilled {
                        first_token: a.first_token,
                        held: a.held.as_ref().map(|h| Held {
                            block_ids: h.block_ids.clone(),
                            lease: Duration::from_millis(h.lease_ms),
                        }),
                    };
                    (PullEvent::Prefilled(prefilled), Some(a))
                }
            }
            Ok(PeerAnswer::Failed(error)) => not_sent(error),
            Ok(other) => not_sent(HandoffError::Protocol(format!(
                "{peer} answered Prefill with {}",
                other.name()
            ))),
            Err(error) => {
                let failed = PullEvent::PrefillFailed {
                    error,
                    answered: false,
                };
                (failed, None)
            }
        }
    }

    /// Reads the held blocks into ours: one batch per local rank, joined by the Aggregator.
    /// Every batch is awaited to its end, even after one failed: our blocks may not be
    /// released while a read can still land in them. `device_read` is set when the blocks
    /// were copied device to device (CUDA IPC) rather than landed in registered memory.
    #[allow(clippy::too_many_arguments)]
    async fn read(
        self,
        peer: PeerAddr,
        transfer: TransferId,
        remote: Vec<u32>,
        local: Vec<u32>,
        cached_blocks: usize,
        prompt_len: usize,
        device_read: Arc<std::sync::atomic::AtomicBool>,
    ) -> PullEvent {
        // Same-GPU peers: the path negotiated at the handshake may be CUDA IPC, which copies
        // device to device instead of through the engine (`super::device`; never on CPU).
        match super::device::DeviceRead::prepare(
            &self.kv,
            &peer,
            &remote,
            &local,
            cached_blocks,
            prompt_len,
        )
        .await
        {
            Ok(Some(copies)) => {
                device_read.store(true, std::sync::atomic::Ordering::Release);
                let r = copies.run(&self.kv, &self.aggregator, transfer).await;
                return PullEvent::ReadsDone(r);
            }
            Ok(None) => {}
            Err(e) => return PullEvent::ReadsRefused(e),
        }
        // Everything before the first batch is submitted can refuse the hand-off without any
        // byte having moved.
        let prepared = async {
            let kv = &self.kv;
            let ours = kv.info();
            let theirs = kv.peers.info(&peer, &ours).await?;
            // Every block id the peer named is checked, cached or not: forged metadata is
            // refused whatever our prefix cache holds.
            let n = check_blocks(&ours, &theirs, &local, &remote, prompt_len)?;
            // Delta transfer: the leading blocks we hold from our prefix cache are not read.
            let skip = cached_blocks.min(n.saturating_sub(1));
            let bs = kv.settings.block_size;
            let per_rank = plan_pull(
                &ours,
                &theirs,
                &local[skip..],
                &remote[skip..],
                prompt_len - skip * bs,
            )?;
            let session = kv
                .peers
                .session_for(kv.registry.engine(), &peer, &theirs)
                .await?;
            // On backends with fenced scopes, the prefill instance opens the read scope of
            // exactly this hand-off's held blocks on our session.
            let (session, fence) = if kv.security().fenced() {
                kv.peers.open_read(&peer, transfer).await?;
                // The session sees the regions of its open scopes.
                let session = kv.peers.ready(session, &theirs).await?;
                (session, Some(fence_id(transfer)))
            } else {
                (session, None)
            };
            Ok::<_, HandoffError>((per_rank, session, fence, theirs.transfer_addr))
        };
        match prepared.await {
            Ok((per_rank, session, fence, addr)) => {
                let r = self.read_batches(transfer, per_rank, session, fence).await;
                if r.as_ref().is_err_and(HandoffError::breaks_session) {
                    self.kv.peers.forget_session(&addr);
                }
                PullEvent::ReadsDone(r)
            }
            Err(e) => PullEvent::ReadsRefused(e),
        }
    }

    async fn read_batches(
        &self,
        transfer: TransferId,
        per_rank: Vec<Vec<pdserve_transport::TransferOp>>,
        session: Arc<pdserve_transport::Session>,
        fence: Option<FenceId>,
    ) -> Result<(), HandoffError> {
        let kv = &self.kv;
        let bound = kv.bounds().transfer;
        let mut per_rank: Vec<Option<Vec<pdserve_transport::TransferOp>>> =
            per_rank.into_iter().map(Some).collect();
        super::aggregator::joined(
            &self.aggregator,
            transfer,
            kv.epochs.current(),
            bound,
            |rank| {
                let ops = per_rank.get_mut(rank).and_then(Option::take);
                let session = session.clone();
                async move {
                    let Some(mut ops) = ops else {
                        return RankReport::Failed(HandoffError::Interrupted(format!(
                            "no reads were planned for rank {rank}"
                        )));
                    };
                    let submitted = match kv.transfer_fault(&mut ops).await {
                        Ok(()) => submit_ops(&session, fence, &ops).await,
                        Err(e) => Err(e),
                    };
                    match submitted {
                        Ok(batch) => match batch.wait(bound).await {
                            Ok(()) => {
                                kv.received(batch.bytes());
                                RankReport::Done
                            }
                            Err(e) => RankReport::Failed(HandoffError::transfer(&e)),
                        },
                        Err(e) => RankReport::Failed(e),
                    }
                }
            },
        )
        .await
    }

    async fn release(self, peer: PeerAddr, transfer: TransferId) -> PullEvent {
        let r = self
            .kv
            .peers
            .call(
                &peer,
                &PeerRequest::Release(transfer),
                self.kv.bounds().transfer,
            )
            .await;
        PullEvent::Released(match r {
            Ok(PeerAnswer::Released { was_held }) => Ok(was_held),
            Ok(PeerAnswer::Failed(e)) | Err(e) => Err(e),
            Ok(other) => Err(HandoffError::Protocol(format!(
                "{peer} answered Release with {}",
                other.name()
            ))),
        })
    }

    /// Asks the prefill instance to drop the hand-off (abort its prefill, stop its writes,
    /// free held blocks); it answers once none of its writes is in flight.
    async fn abort(self, peer: PeerAddr, transfer: TransferId) -> PullEvent {
        let r = self
            .kv
            .peers
            .call(
                &peer,
                &PeerRequest::Abort(transfer),
                self.kv.bounds().transfer,
            )
            .await;
        PullEvent::AbortAnswered(match r {
            Ok(PeerAnswer::Aborted { .. }) => Ok(()),
            Ok(PeerAnswer::Failed(e)) | Err(e) => {
                tracing::info!(%transfer, %peer, error = %e, "the prefill instance did not confirm the abort");
                Err(e)
            }
            Ok(other) => Err(HandoffError::Protocol(format!(
                "{peer} answered Abort with {}",
                other.name()
            ))),
        })
    }
}

/// The destination blocks a completed hand-off wrote: the prompt's blocks past the ones our
/// prefix cache held, the last one always (a read moves it even when it was cached; a push
/// is refused when everything is cached).
fn landed(local: &[u32], cached_blocks: usize, prompt_len: usize, block_size: usize) -> Vec<u32> {
    let n = prompt_len.div_ceil(block_size).min(local.len());
    let skip = cached_blocks.min(n.saturating_sub(1));
    local[skip..n].to_vec()
}

/// Sleeps until `deadline` (forever without one; the caller guards the branch).
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}
