//! The Scheduler actor: owns the request queues and the KV block pool of one instance
//! ([`SchedulerCore`]), plans one forward step at a time, sends it to every TpWorker, joins
//! their reports (by rank index, per step id and epoch) and streams tokens to each request's
//! owner.
//!
//! Messages: [`SchedulerMsg`]; other code talks to it through a [`SchedulerHandle`] (typed
//! calls with the configured timeout). Supervised by the `InstanceSupervisor`, which reports
//! worker failures (`WorkerDown`); workers report through `Worker` (ready, step done). When a worker fails, every request in the
//! step it was running ends with a 5xx [`RequestError::WorkerFailed`] and its blocks return to
//! the pool; scheduling resumes once every rank is back. If the Scheduler itself fails, the
//! supervisor escalates: the requests it held cannot be recovered.

mod core;
mod handle;

pub use self::core::{
    image_key_token, NewRequest, Output, PromptImage, RemoteAdmission, RequestState,
    SchedulerConfig, SchedulerCore, SchedulerStats, StepPlan,
};
pub use self::handle::{RequestStream, SchedulerHandle};

use crate::block_manager::BlockAllocation;
use crate::error::RequestError;
use crate::handoff::protocol::unix_now_us;
use crate::handoff::push::{PushChunk, PushEvent};
use crate::handoff::receiver::{Fetch, FetchOutcome, FetchReply, KvReceiverHandle, KvSource};
use crate::handoff::sender::KvSenderHandle;
use crate::handoff::HandoffError;
use crate::kv_tiers::{KvTiers, RestoreStream, SpillDone, StreamFailure};
use crate::mailbox::{Inbox, Mailbox};
use crate::timers::{Timer, Timers};
use crate::worker::{StepError, WorkerHandle, WorkerReport};
use pdserve_gpu::model::Batch;
use pdserve_gpu::sampling::{FinishReason, TokenLogprobs};
use pdserve_gpu::ModelError;
use pdserve_runtime::ids::{RequestId, TransferId};
use pdserve_runtime::supervision::ActorKind;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::error::TrySendError;

/// Where a request's events go: a bounded channel sized for every event the request can
/// produce (see [`SchedulerHandle::submit`]), so the Scheduler never waits on it.
pub type EventSink = tokio::sync::mpsc::Sender<RequestEvent>;

/// What a request's owner (an HTTP handler) receives.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// A token and the text that became final with it.
    Token {
        /// Token id.
        token: u32,
        /// Text (possibly empty).
        text: String,
        /// Its logprobs, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The prompt's logprobs (entry `i`: prompt token `i + 1`), before the first token, when
    /// the request asked for them.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Last text.
        text: String,
        /// Token counts.
        usage: crate::openai::Usage,
        /// Blocks held for a decode instance (prefill side of P/D).
        held_blocks: Option<Vec<u32>>,
    },
    /// Failure.
    Failed(RequestError),
}

/// Messages of the Scheduler.
pub enum SchedulerMsg {
    /// A new request; its events go to `sink` (a dropped receiver aborts it).
    Submit {
        /// The request.
        request: NewRequest,
        /// Where its events go.
        sink: EventSink,
    },
    /// A request whose prompt KV comes from a prefill instance (decode side of P/D).
    SubmitRemote {
        /// The request (its prompt is what the prefill side computed).
        request: NewRequest,
        /// Where its events go.
        sink: EventSink,
        /// Where the KV comes from.
        source: KvSource,
    },
    /// The ranks copied out, for the KV tiers, what a hand-off's destination blocks held:
    /// the fetch may write them now (sent to the KvReceiver unless the request is gone).
    StartFetch(Box<Fetch>),
    /// The KvReceiver finished (or failed) bringing a request's KV in.
    RemoteKvDone {
        /// Request.
        id: RequestId,
        /// T0 from the prefill side, or the failure.
        outcome: FetchOutcome,
    },
    /// A rank ended uploading a request's landed KV from its host mirror to its device
    /// (device KV caches only; see [`SchedulerArgs::upload_landed_kv`]).
    KvUploaded {
        /// Request.
        id: RequestId,
        /// Rank.
        rank: usize,
        /// The worker epoch the upload was sent to.
        epoch: u64,
        /// Done, or why not (the rank's executor's error: a device error, its queue full,
        /// its thread gone).
        result: Result<(), ModelError>,
    },
    /// A decode instance renews the leases of blocks held for it; answers the transfers no
    /// longer held.
    RenewHeld(Vec<TransferId>, RpcReplyPort<Vec<TransferId>>),
    /// The blocks held for a transfer, while its lease lives (to scope a reader's session).
    HeldBlocks(TransferId, RpcReplyPort<Option<Vec<u32>>>),
    /// A decode instance gave up on a hand-off: abort the request computing it (its owner
    /// gets [`RequestError::Aborted`]) or free the blocks held for it. Answers whether
    /// anything was found.
    AbortTransfer(TransferId, RpcReplyPort<bool>),
    /// A decode instance read the blocks held for a transfer; answers whether the lease was
    /// still alive.
    ReleaseHeld(TransferId, RpcReplyPort<bool>),
    /// Periodic upkeep (lease expiry).
    Tick,
    /// The owner gave up on a request (client disconnect).
    Abort(RequestId),
    /// A worker's report: ready for steps, or a step done.
    Worker(WorkerReport),
    /// A worker died; its supervisor is restarting it.
    WorkerDown {
        /// Rank.
        rank: usize,
        /// What happened.
        reason: String,
    },
    /// Queue and pool figures.
    Stats(RpcReplyPort<SchedulerStats>),
    /// The prefix cache's events since the last drain (a snapshot when asked or due).
    KvEvents(bool, RpcReplyPort<crate::kv_events::KvEventBatch>),
    /// KV tiers: the blocks of a new request's prompt that a blocking task loaded and
    /// verified (possibly none); restore them, then admit the request.
    TiersLoaded(Box<TierLoad>),
    /// KV tiers: the ranks ended writing a request's restored blocks; register them (when
    /// every rank wrote them into the cache that is still current), then admit the request.
    TiersRestored(Box<TierRestore>),
    /// KV tiers: a load ran past `kv_tiers.load_timeout_ms`; the request it holds is admitted
    /// without the tiers (the late answer is dropped) and the disk tier pauses.
    TierLoadTimedOut(u64),
}

/// A request waiting for its prompt's blocks from the KV tiers (see
/// [`SchedulerMsg::TiersLoaded`]).
pub struct TierLoad {
    /// Which load (its request waits in the Scheduler's `tier_waiting`).
    load_id: u64,
    /// The hashes of the prompt's full blocks (all but its last token).
    hashes: Vec<crate::block_manager::BlockHash>,
    /// Their tokens.
    tokens: Vec<u32>,
    /// The first block the tiers were asked for (the pool held those before it).
    start: usize,
    /// Blocks `start..`, loaded and verified, or opened for a streamed restore.
    loaded: Loaded,
    /// When the lookup found them (the load-back latency counts from here).
    started: std::time::Instant,
}

/// What a KV-tier load produced.
enum Loaded {
    /// Every block read and verified.
    Whole(Vec<Arc<crate::kv_tiers::TierBlock>>),
    /// Every block opened; a blocking task reads their layers into `stream` (the request's
    /// first step takes them as they land: [`crate::kv_tiers::stream`]).
    Stream {
        stream: Arc<RestoreStream>,
        /// Each block's stored hit count.
        hits: Vec<u32>,
    },
}

impl Loaded {
    fn len(&self) -> usize {
        match self {
            Loaded::Whole(b) => b.len(),
            Loaded::Stream { hits, .. } => hits.len(),
        }
    }
}

/// A request admitted with a streamed KV-tier restore, until its first step ends.
struct Streaming {
    stream: Arc<RestoreStream>,
    /// When the lookup found the blocks.
    started: std::time::Instant,
}

/// A request's prefix being restored layer by layer: the pool's blocks `..first` and fresh
/// blocks for the stream's, and where the stream's layers land.
struct Restored {
    prefix: BlockAllocation,
    first: usize,
    /// Each streamed block's stored hit count.
    hits: Vec<u32>,
    stream: Arc<RestoreStream>,
    started: std::time::Instant,
}

impl Restored {
    fn into_streaming(self) -> Streaming {
        Streaming {
            stream: self.stream,
            started: self.started,
        }
    }
}

/// What waits on a KV-tier load: a request, where its answers go, and for a P/D request the
/// prefill instance its KV comes from (after the load it goes to `submit_remote`, which then
/// fetches only what the pool and the restored blocks lack).
type Waiting = (NewRequest, EventSink, Option<KvSource>);

/// A restore whose rank jobs ended (see [`SchedulerMsg::TiersRestored`]).
pub struct TierRestore {
    request: NewRequest,
    sink: EventSink,
    source: Option<KvSource>,
    /// The fresh blocks holding blocks `first..` of `hashes`.
    alloc: BlockAllocation,
    /// The pool's blocks `..first`, held meanwhile.
    pin: BlockAllocation,
    hashes: Vec<crate::block_manager::BlockHash>,
    tokens: Vec<u32>,
    first: usize,
    hits: Vec<u32>,
    /// Worker epochs when the jobs were queued.
    epochs: Vec<Option<u64>>,
    /// Whether every rank wrote every block.
    ok: bool,
    /// When the lookup found the blocks ([`TierLoad::started`]).
    started: std::time::Instant,
}

/// KV-tier loads (blocking tasks) in flight at most; past that a request is admitted without
/// asking the tiers.
const MAX_TIER_LOADS: usize = 16;

/// The Scheduler actor (its mailbox count; state lives in [`SchedulerState`]).
#[derive(Debug)]
pub struct Scheduler(pub Inbox);

/// Arguments to start a Scheduler.
pub struct SchedulerArgs {
    /// Limits.
    pub config: SchedulerConfig,
    /// Tokenizer (for streaming text).
    pub tokenizer: pdserve_gpu::tokenizer::Tokenizer,
    /// Number of TP ranks.
    pub tp: usize,
    /// One end of the ranks' collective, to clear it after a failed step once no rank is
    /// inside it any more.
    pub collective: pdserve_gpu::collective::ThreadCollective,
    /// The KV receiver (instances with a transfer engine).
    pub kv_receiver: Option<KvReceiverHandle>,
    /// The KV sender (instances with a transfer engine).
    pub kv_sender: Option<KvSenderHandle>,
    /// Vocabulary size (validates peer-supplied first tokens).
    pub vocab_size: usize,
    /// The KV cache tiers below the block pool (`[kv_tiers]`), if on.
    pub tiers: Option<Arc<KvTiers>>,
    /// Whether KV that a hand-off landed must be uploaded to each rank's device before the
    /// request decodes (ranks with a device KV cache and a host mirror).
    pub upload_landed_kv: bool,
    /// Whether peers can read the KV this instance computes (false for a device KV cache
    /// whose mirror only receives: requests that hold KV for a peer are refused).
    pub serves_kv: bool,
    /// Test-only fault injection (`[faults]`): late spill ends.
    pub faults: Option<Arc<pdserve_runtime::faults::FaultInjector>>,
}

/// Decode side, device KV: a request whose KV landed in the ranks' host mirrors, waiting for
/// every rank's upload to the device before it may decode.
struct PendingUpload {
    first_token: u32,
    first_logprobs: Option<TokenLogprobs>,
    prefill_cached: usize,
    /// The epoch of each rank's worker the upload went to.
    epochs: Vec<u64>,
    /// Ranks whose upload completed.
    done: Vec<bool>,
}

struct InFlight {
    plan: StepPlan,
    /// When it was sent to the workers.
    sent: Instant,
    /// Whether the KvSender was told about pushed chunks of this step.
    pushes: bool,
    replies: Vec<Option<Result<Vec<Vec<f32>>, StepError>>>,
}

/// Decode side: where a request's prompt KV came from, and when.
struct Remote {
    transfer: TransferId,
    /// Worker epochs when the hand-off started: KV landing in a cache that a restarted
    /// worker replaced since is gone.
    epochs: Vec<u64>,
    /// When the prefill instance had the prompt computed (µs since the Unix epoch).
    computed_at_unix_us: Option<u64>,
    /// Whether the first decode step was scheduled (the hand-off gap is measured once).
    stepped: bool,
}

struct Owner {
    sink: EventSink,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Prefill side: the transfer its blocks are held for.
    hold_for: Option<TransferId>,
    /// Decode side of a remote request.
    remote: Option<Remote>,
}

impl Owner {
    fn new(sink: EventSink, hold_for: Option<TransferId>, remote: Option<Remote>) -> Self {
        Self {
            sink,
            arrived: Instant::now(),
            first_token: None,
            last_token: None,
            hold_for,
            remote,
        }
    }
}

/// The Scheduler's mutable state.
pub struct SchedulerState {
    core: SchedulerCore,
    owners: HashMap<RequestId, Owner>,
    workers: Vec<Option<(u64, WorkerHandle)>>,
    in_flight: Option<InFlight>,
    /// Ranks that still owe a reply to a step that failed: the collective is reset only when
    /// none is left inside it.
    draining: Vec<bool>,
    collective: pdserve_gpu::collective::ThreadCollective,
    needs_reset: bool,
    kv_receiver: Option<KvReceiverHandle>,
    kv_sender: Option<KvSenderHandle>,
    /// Hand-offs aborted before their prompt arrived (the decode side's Abort can overtake
    /// its Prefill): a later prompt for one is refused, not computed for nobody.
    aborted_transfers: crate::handoff::aborts::RecentAborts,
    me: Mailbox<SchedulerMsg>,
    vocab_size: usize,
    tiers: Option<Arc<KvTiers>>,
    /// KV-tier loads in flight.
    tier_loads: usize,
    /// Requests whose tier load is under way, by load id.
    tier_waiting: HashMap<u64, Waiting>,
    /// The Tick and the tier loads' deadlines: they end with this incarnation.
    timers: Timers,
    /// Each tier load's deadline, cancelled when the load ends first.
    load_timers: HashMap<u64, Timer>,
    /// Requests admitted with a streamed restore whose first step has not ended.
    streaming: HashMap<RequestId, Streaming>,
    /// Seconds a step took per token it computed, over recent steps of many tokens (an
    /// average that moves by a quarter per step): how long a streamed restore's request
    /// will compute, so its load can be admitted before it ends.
    prefill_pace: Option<f64>,
    next_load_id: u64,
    /// Blocks held until the end of the current message (restored prefixes, so the step
    /// planned right after cannot evict them before their request is admitted).
    pins: Vec<BlockAllocation>,
    /// See [`SchedulerArgs::upload_landed_kv`].
    upload_landed_kv: bool,
    /// See [`SchedulerArgs::serves_kv`].
    serves_kv: bool,
    /// See [`SchedulerArgs::faults`].
    faults: Option<Arc<pdserve_runtime::faults::FaultInjector>>,
    /// Requests whose landed KV is being uploaded, by request.
    uploads: HashMap<RequestId, PendingUpload>,
}

impl Actor for Scheduler {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SchedulerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let me = Mailbox::of(&myself, &self.0);
        let mut timers = Timers::default();
        timers.every(std::time::Duration::from_secs(1), me.clone(), || {
            SchedulerMsg::Tick
        });
        let core = SchedulerCore::new(args.config, args.tokenizer);
        if args.tiers.is_some() {
            core.block_manager().spill_evictions(true);
        }
        Ok(SchedulerState {
            me,
            core,
            tiers: args.tiers,
            tier_loads: 0,
            tier_waiting: HashMap::new(),
            timers,
            load_timers: HashMap::new(),
            streaming: HashMap::new(),
            prefill_pace: None,
            next_load_id: 0,
            pins: Vec::new(),
            owners: HashMap::new(),
            workers: vec![None; args.tp],
            in_flight: None,
            draining: vec![false; args.tp],
            collective: args.collective,
            needs_reset: false,
            kv_receiver: args.kv_receiver,
            kv_sender: args.kv_sender,
            aborted_transfers: Default::default(),
            vocab_size: args.vocab_size,
            upload_landed_kv: args.upload_landed_kv,
            faults: args.faults,
            serves_kv: args.serves_kv,
            uploads: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            SchedulerMsg::SubmitRemote {
                request,
                sink,
                source,
            } => {
                // The decode side of a hand-off: blocks of the prompt that its own KV tiers
                // (or the shared store) hold are restored first, then only the rest is
                // fetched from the prefill instance.
                if let Some((request, sink, source)) =
                    st.load_from_tiers(request, sink, Some(source))
                {
                    st.proceed(request, sink, source);
                }
            }
            SchedulerMsg::StartFetch(fetch) => st.start_fetch(fetch),
            SchedulerMsg::RemoteKvDone { id, outcome } => {
                // KV that landed in a cache a restarted worker has replaced is gone; so is KV
                // landing while a worker is down (its replacement allocates a fresh cache).
                let current = st.worker_epochs();
                let remote = st.owners.get_mut(&id).and_then(|o| o.remote.as_mut());
                let cache_intact = remote
                    .as_ref()
                    .is_none_or(|r| current.iter().zip(&r.epochs).all(|(c, e)| *c == Some(*e)));
                if let Some(r) = remote {
                    r.computed_at_unix_us = outcome.computed_at_unix_us;
                }
                let result = match outcome.result {
                    Ok(_) if !cache_intact => Err(HandoffError::CacheLost(
                        "a TP worker restarted while this request's KV was arriving".into(),
                    )),
                    r => r,
                };
                let out = match result {
                    // With a device KV cache the KV landed in the host mirrors: every rank
                    // uploads it before the request may decode.
                    Ok(first_token)
                        if st.upload_landed_kv
                            && !outcome.landed_blocks.is_empty()
                            && st.receiving_kv(id) =>
                    {
                        st.start_upload(
                            id,
                            outcome.landed_blocks,
                            PendingUpload {
                                first_token,
                                first_logprobs: outcome.first_logprobs,
                                prefill_cached: outcome
                                    .prefill_cached_tokens
                                    .map_or(0, |n| n as usize),
                                epochs: Vec::new(),
                                done: Vec::new(),
                            },
                        )
                    }
                    // An abort while the KV was landing leaves nothing to resume.
                    Ok(first_token) => st
                        .core
                        .remote_kv_ready(
                            id,
                            first_token,
                            outcome.first_logprobs,
                            outcome.prefill_cached_tokens.map_or(0, |n| n as usize),
                            Instant::now(),
                        )
                        .unwrap_or_default(),
                    Err(e) => {
                        if st.core.abort(id) {
                            vec![Output::Failed {
                                id,
                                error: RequestError::KvTransfer(e),
                            }]
                        } else {
                            Vec::new()
                        }
                    }
                };
                st.dispatch(out);
            }
            SchedulerMsg::KvUploaded {
                id,
                rank,
                epoch,
                result,
            } => {
                let out = st.on_uploaded(id, rank, epoch, result);
                st.dispatch(out);
            }
            SchedulerMsg::HeldBlocks(transfer, reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.core.held_blocks(transfer));
                }
            }
            SchedulerMsg::RenewHeld(transfers, reply) => {
                let gone = st.core.renew_many(&transfers, Instant::now());
                if !reply.is_closed() {
                    let _ = reply.send(gone);
                }
            }
            SchedulerMsg::AbortTransfer(transfer, reply) => {
                let found = match st.core.request_of(transfer) {
                    Some(id) => {
                        tracing::info!(request = %id, %transfer, "hand-off aborted by the decode side");
                        st.abort_request(id);
                        if let Some(owner) = st.owners.remove(&id) {
                            let _ = owner
                                .sink
                                .try_send(RequestEvent::Failed(RequestError::Aborted));
                        }
                        true
                    }
                    None => {
                        let held = st.core.release_held(transfer);
                        if !held {
                            st.aborted_transfers.insert(transfer, Instant::now());
                        }
                        held
                    }
                };
                if !reply.is_closed() {
                    let _ = reply.send(found);
                }
            }
            SchedulerMsg::ReleaseHeld(transfer, reply) => {
                let was_held = st.core.release_held(transfer);
                if !reply.is_closed() {
                    let _ = reply.send(was_held);
                }
            }
            SchedulerMsg::Tick => {
                let now = Instant::now();
                st.core.expire_held(now);
                st.aborted_transfers.forget_expired(now);
            }
            SchedulerMsg::Submit { request, sink } => {
                let (id, hold_for) = (request.id, request.hold_for);
                if let Some(transfer) =
                    hold_for.filter(|&t| st.aborted_transfers.contains(t, Instant::now()))
                {
                    tracing::info!(request = %id, %transfer, "hand-off aborted before its prompt arrived");
                    let _ = sink.try_send(RequestEvent::Failed(RequestError::Aborted));
                    return Ok(());
                }
                if let Some((request, sink, source)) = st.load_from_tiers(request, sink, None) {
                    st.proceed(request, sink, source);
                }
            }
            SchedulerMsg::TiersLoaded(load) => st.on_tiers_loaded(*load),
            SchedulerMsg::TiersRestored(restore) => st.on_tiers_restored(*restore),
            SchedulerMsg::TierLoadTimedOut(load_id) => {
                st.load_timers.remove(&load_id);
                if let Some((request, sink, source)) = st.tier_waiting.remove(&load_id) {
                    st.tier_loads = st.tier_loads.saturating_sub(1);
                    if let Some(t) = &st.tiers {
                        t.load_timed_out();
                    }
                    st.proceed(request, sink, source);
                }
            }
            SchedulerMsg::Abort(id) => {
                if st.abort_request(id) {
                    tracing::debug!(request = %id, "aborted by its owner");
                    metrics::counter!(pdserve_runtime::telemetry::REQUESTS_TOTAL, "outcome" => "aborted").increment(1);
                }
                st.owners.remove(&id);
            }
            SchedulerMsg::Worker(WorkerReport::StepDone {
                epoch,
                step_id,
                rank,
                result,
            }) => {
                st.on_step_done(epoch, step_id, rank, result);
            }
            SchedulerMsg::Worker(WorkerReport::Up {
                rank,
                epoch,
                worker,
            }) => {
                st.workers[rank] = Some((epoch, worker));
            }
            SchedulerMsg::WorkerDown { rank, reason } => {
                tracing::warn!(rank, %reason, "worker down; failing the step it held");
                st.workers[rank] = None;
                st.needs_reset = true;
                if let Some(inf) = st.in_flight.take() {
                    for (r, reply) in inf.replies.iter().enumerate() {
                        st.draining[r] = r != rank && reply.is_none() && st.workers[r].is_some();
                    }
                    for (_, w) in st.workers.iter().flatten() {
                        w.poison(reason.clone());
                    }
                    st.step_failed(inf.plan.step_id, inf.pushes);
                    let out = st.core.fail_step(
                        inf.plan,
                        RequestError::WorkerFailed(format!("TP rank {rank} failed: {reason}")),
                    );
                    st.dispatch(out);
                }
                // The restarted rank starts from an empty cache: what was computed is
                // recomputed, and KV arriving from a prefill instance lands in memory that is
                // gone, so those requests fail.
                let mut out = Vec::new();
                for id in st.core.receiving() {
                    st.uploads.remove(&id);
                    st.abort_request(id);
                    out.push(Output::Failed {
                        id,
                        error: RequestError::KvTransfer(HandoffError::CacheLost(format!(
                            "TP rank {rank} restarted while this request's KV was arriving"
                        ))),
                    });
                }
                st.core.cache_lost();
                st.sweep_streams();
                // Evicted blocks not yet copied out name KV that is gone.
                let lost = st.core.block_manager().take_evicted().len();
                if let Some(t) = &st.tiers {
                    t.not_spilled(lost);
                }
                st.dispatch(out);
            }
            SchedulerMsg::KvEvents(snapshot, reply) => {
                let mut batch = st.core.block_manager().kv_events(snapshot);
                if let Some(t) = &st.tiers {
                    batch.tiers = t.kv_events(snapshot);
                }
                if !reply.is_closed() {
                    let _ = reply.send(batch);
                }
            }
            SchedulerMsg::Stats(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.core.stats());
                }
            }
        }
        st.maybe_step();
        st.pins.clear();
        st.publish_gauges();
        Ok(())
    }
}

impl SchedulerState {
    /// Accepts a local request into the core.
    fn admit(&mut self, request: NewRequest, sink: EventSink) {
        self.admit_into(request, sink, None);
    }

    /// [`SchedulerState::admit`], with the prefix `restored` streams from the KV tiers when
    /// there is one (see [`SchedulerState::admit_streamed`]); a request refused here gives
    /// its stream up.
    fn admit_into(&mut self, request: NewRequest, sink: EventSink, restored: Option<Restored>) {
        let (id, hold_for) = (request.id, request.hold_for);
        // Checked again here: a hand-off can be aborted while its prompt waits for the tiers.
        let refused = if let Some(transfer) =
            hold_for.filter(|&t| self.aborted_transfers.contains(t, Instant::now()))
        {
            tracing::info!(request = %id, %transfer, "hand-off aborted before its prompt arrived");
            Some(RequestError::Aborted)
        } else if hold_for.is_some() && !self.serves_kv {
            Some(RequestError::BadRequest(
                "this instance keeps its KV on the device without a host mirror peers can \
                 read (only role prefill writes one through): it cannot hand KV to a peer"
                    .into(),
            ))
        } else {
            None
        };
        let prompt_tokens = request.prompt.len();
        let (added, streaming) = match (refused, restored) {
            (Some(e), restored) => (Err(e), restored.map(Restored::into_streaming)),
            (None, None) => (self.core.add(request), None),
            (None, Some(r)) => {
                let Restored {
                    prefix,
                    first,
                    hits,
                    stream,
                    started,
                } = r;
                let added = self.core.add_restored(request, prefix, first, hits);
                (added, Some(Streaming { stream, started }))
            }
        };
        match added {
            Ok(()) => {
                metrics::counter!(pdserve_runtime::telemetry::PROMPT_TOKENS_TOTAL)
                    .increment(prompt_tokens as u64);
                self.owners.insert(id, Owner::new(sink, hold_for, None));
                if let Some(s) = streaming {
                    self.streaming.insert(id, s);
                }
            }
            Err(e) => {
                if let Some(s) = streaming {
                    s.stream.fail(StreamFailure::Abandoned);
                }
                let _ = sink.try_send(RequestEvent::Failed(e));
            }
        }
    }

    /// Admits a local request, or hands a P/D request (`source`) to the KV receiver.
    fn proceed(&mut self, request: NewRequest, sink: EventSink, source: Option<KvSource>) {
        match source {
            None => self.admit(request, sink),
            Some(source) => self.submit_remote(request, sink, source),
        }
    }

    /// KV tiers: when the tiers hold blocks of the request's prompt that the pool lacks
    /// (right after the pool's cached prefix), loads them in a blocking task and returns
    /// `None` (the request comes back as [`SchedulerMsg::TiersLoaded`]); else gives the
    /// request back to go on now ([`SchedulerState::proceed`]).
    fn load_from_tiers(
        &mut self,
        request: NewRequest,
        sink: EventSink,
        source: Option<KvSource>,
    ) -> Option<Waiting> {
        let Some(tiers) = self.tiers.clone() else {
            return Some((request, sink, source));
        };
        let cfg = self.core.config();
        let (bs, salt) = (cfg.block_size, cfg.cache_salt);
        let len = request.prompt.len() + request.resume.len();
        let max = len.saturating_sub(1) / bs;
        if !cfg.prefix_cache
            || max == 0
            || request.params.prompt_logprobs.is_some()
            || self.tier_loads >= MAX_TIER_LOADS
            || !tiers.may_queue_jobs()
        {
            return Some((request, sink, source));
        }
        // Keyed as the prefix cache keys them: an image's rows by its digest.
        let tokens = self::core::key_tokens(
            request
                .prompt
                .iter()
                .chain(&request.resume)
                .copied()
                .take(max * bs)
                .collect(),
            &request.images,
        );
        let hashes = crate::block_manager::block_hashes(salt, &tokens, bs);
        let start = self.core.block_manager().lookup(&hashes, &tokens, bs);
        let count = tiers.contains_run(&hashes[start..]);
        if count == 0 {
            return Some((request, sink, source));
        }
        // A request whose prompt is computed here streams its restore layer by layer (a
        // prefill instance's too: its decode peer reads the blocks once the request ended,
        // after the restore was settled). Loaded whole: a decode instance's P/D request
        // (nothing computes while it loads), and a pushed hand-off, whose layers go to the
        // peer as the step computes them.
        let stream = tiers.streams() && source.is_none() && !request.push;
        self.tier_loads += 1;
        self.next_load_id += 1;
        let load_id = self.next_load_id;
        self.tier_waiting.insert(load_id, (request, sink, source));
        let me = self.me.clone();
        let timeout = tiers.load_timeout();
        let timer = self.timers.after(
            timeout,
            self.me.clone(),
            SchedulerMsg::TierLoadTimedOut(load_id),
        );
        self.load_timers.insert(load_id, timer);
        let started = std::time::Instant::now();
        let hold_last = self.faults.as_ref().is_some_and(|f| f.tier_stream_hold());
        // How long its step will compute the rest of the prompt (less a margin): a streamed
        // load is admitted once what it still has to read would land within that.
        let rest = len.saturating_sub((start + count) * bs);
        let budget = self.prefill_pace.map_or(std::time::Duration::ZERO, |secs| {
            std::time::Duration::from_secs_f64(0.8 * secs * rest as f64)
        });
        tokio::task::spawn_blocking(move || {
            let (run, parent) = (
                &hashes[start..start + count],
                start.checked_sub(1).map(|p| hashes[p]),
            );
            let (loaded, reader) = if stream {
                let load = tiers.open_stream(
                    run,
                    &tokens[start * bs..],
                    parent,
                    started + timeout,
                    hold_last,
                );
                let loaded = Loaded::Stream {
                    stream: load.stream().clone(),
                    hits: load.hits(),
                };
                (loaded, Some(load))
            } else {
                let blocks = tiers.load_run(run, &tokens[start * bs..], parent);
                (Loaded::Whole(blocks), None)
            };
            let load = TierLoad {
                load_id,
                hashes,
                tokens,
                start,
                loaded,
                started,
            };
            // A streamed request is admitted while its layers land (when `reader` says the
            // rest will land within its step's compute); its step takes them as they do.
            let admit = move || {
                me.tell(
                    ActorKind::Scheduler,
                    "tiers_loaded",
                    SchedulerMsg::TiersLoaded(Box::new(load)),
                );
            };
            match reader {
                Some(reader) => reader.run(budget, admit),
                None => admit(),
            }
        });
        None
    }

    /// Writes the loaded blocks into fresh pool blocks on every rank (after copying out what
    /// the allocation evicted); the request is admitted when the ranks are done
    /// ([`SchedulerState::on_tiers_restored`]), or now when nothing can be restored.
    fn on_tiers_loaded(&mut self, load: TierLoad) {
        let TierLoad {
            load_id,
            hashes,
            tokens,
            start,
            loaded,
            started,
        } = load;
        let give_up = |loaded: &Loaded| {
            if let Loaded::Stream { stream, .. } = loaded {
                stream.fail(StreamFailure::Abandoned);
            }
        };
        let Some((request, sink, source)) = self.tier_waiting.remove(&load_id) else {
            return give_up(&loaded); // timed out: the request went on without the tiers
        };
        if let Some(deadline) = self.load_timers.remove(&load_id) {
            deadline.cancel();
        }
        self.tier_loads = self.tier_loads.saturating_sub(1);
        if sink.is_closed() {
            give_up(&loaded);
            return self.abandon(request.id, source); // the client left meanwhile
        }
        let Some(tiers) = self.tiers.clone() else {
            give_up(&loaded);
            return self.proceed(request, sink, source);
        };
        let bs = self.core.config().block_size;
        let bm = self.core.block_manager().clone();
        // The pool may have gained or lost blocks of this prefix meanwhile.
        let now = bm.lookup(&hashes, &tokens, bs);
        let end = start + loaded.len();
        let streamed = matches!(loaded, Loaded::Stream { .. });
        if now < start
            || now >= end
            // A stream writes the blocks it opened, all of them; a failed one none.
            || (streamed && now != start)
            || matches!(&loaded, Loaded::Stream { stream, .. } if matches!(stream.verdict(), Some(Err(_))))
            || !tiers.may_queue_jobs()
            || self.workers.iter().any(Option::is_none)
        {
            give_up(&loaded);
            return self.proceed(request, sink, source);
        }
        let pin = bm.pin_prefix(&hashes[..now], &tokens[..now * bs], bs);
        let blocks = match loaded {
            Loaded::Whole(blocks) => blocks,
            Loaded::Stream { stream, hits } => {
                return self.admit_streamed(request, sink, pin, now, stream, hits, started);
            }
        };
        let todo = &blocks[now - start..];
        let mut alloc = bm.empty();
        if !bm.can_admit(todo.len()) || !bm.grow(&mut alloc, todo.len()) {
            drop(pin);
            return self.proceed(request, sink, source);
        }
        // What this allocation evicted is read before the restore overwrites it.
        self.flush_spills();
        let items: Vec<(u32, Arc<crate::kv_tiers::TierBlock>)> = alloc
            .blocks()
            .iter()
            .copied()
            .zip(todo.iter().cloned())
            .collect();
        let mut restore = TierRestore {
            request,
            sink,
            source,
            alloc,
            pin,
            hashes,
            tokens,
            first: now,
            hits: todo.iter().map(|b| b.hits.saturating_add(1)).collect(),
            epochs: self.worker_epochs(),
            ok: false,
            started,
        };
        let me = self.me.clone();
        let jobs = crate::kv_tiers::restore_jobs(
            &tiers,
            items,
            Box::new(move |ok| {
                restore.ok = ok;
                me.tell(
                    ActorKind::Scheduler,
                    "tiers_restored",
                    SchedulerMsg::TiersRestored(Box::new(restore)),
                );
            }),
        );
        for (job, w) in jobs.into_iter().zip(&self.workers) {
            if let Some((_, w)) = w {
                w.kv(job);
            }
        }
    }

    /// Admits a request whose prompt blocks `first..` stream from the KV tiers into
    /// fresh pool blocks during its first step (`pin`: the pool's blocks `..first`); or,
    /// when the pool cannot give those blocks now, gives the stream up and admits it as is.
    #[allow(clippy::too_many_arguments)]
    fn admit_streamed(
        &mut self,
        request: NewRequest,
        sink: EventSink,
        mut pin: BlockAllocation,
        first: usize,
        stream: Arc<RestoreStream>,
        hits: Vec<u32>,
        started: Instant,
    ) {
        let bm = self.core.block_manager().clone();
        let mut fresh = bm.empty();
        if !bm.can_admit(hits.len()) || !bm.grow(&mut fresh, hits.len()) {
            stream.fail(StreamFailure::Abandoned);
            return self.admit(request, sink);
        }
        // What this allocation evicted is copied out before the step that carries the
        // stream overwrites it (the spill jobs queue on the ranks ahead of that step).
        self.flush_spills();
        pin.append(fresh);
        let restored = Restored {
            prefix: pin,
            first,
            hits,
            stream,
            started,
        };
        self.admit_into(request, sink, Some(restored));
    }

    /// The [`KvFeed`](pdserve_gpu::tp::KvFeed) of a step whose members restore their
    /// prefixes layer by layer: every rank writes each stream's layer as it lands.
    fn restore_feed(&self, plan: &StepPlan) -> Option<pdserve_gpu::tp::KvFeed> {
        let feeds: Vec<(Arc<RestoreStream>, Vec<u32>)> = plan
            .restores
            .iter()
            .filter_map(|(id, blocks)| {
                let s = self.streaming.get(id)?;
                Some((s.stream.clone(), blocks.clone()))
            })
            .collect();
        if feeds.is_empty() {
            return None;
        }
        Some(Arc::new(move |rank, layer, kv| {
            for (stream, blocks) in &feeds {
                stream.feed(rank, layer, kv, blocks);
            }
        }))
    }

    /// Settles the streamed restores a completed step carried: a verified one's blocks join
    /// the prefix cache; any other outcome (a miss, a timeout, a stream the step did not
    /// carry) restarts its request without the tiers.
    fn settle_restores(&mut self, restores: &[(RequestId, Vec<u32>)]) {
        use pdserve_runtime::telemetry as m;
        for (id, blocks) in restores {
            let entry = self.streaming.remove(id);
            let verdict = entry.as_ref().and_then(|s| s.stream.verdict());
            let verified = verdict == Some(Ok(()));
            if !self.core.restore_settled(*id, verified) {
                continue;
            }
            let Some(s) = entry else {
                tracing::error!(request = %id, "a streamed restore without its stream: recomputing");
                continue;
            };
            let early = s.stream.early_layers();
            if verified {
                if let Some(t) = &self.tiers {
                    t.streamed(early);
                }
                metrics::histogram!(m::KV_TIER_LOAD_SECONDS)
                    .record(s.started.elapsed().as_secs_f64());
                tracing::debug!(request = %id, blocks = blocks.len(), early, "restored KV blocks from the tiers layer by layer");
                continue;
            }
            let why = verdict
                .and_then(Result::err)
                .unwrap_or(StreamFailure::Timeout);
            if why == StreamFailure::Timeout {
                if let Some(t) = &self.tiers {
                    t.load_timed_out();
                }
            }
            tracing::warn!(request = %id, reason = why.as_str(), "a streamed KV tier restore failed: recomputing the request");
        }
    }

    /// Folds a completed step's time per computed token into `prefill_pace` (steps of at
    /// least 16 tokens: a decode step's time is mostly not per token).
    fn note_prefill_pace(&mut self, plan: &StepPlan, took: std::time::Duration) {
        let tokens: usize = plan.members.iter().map(|m| m.1).sum();
        if tokens < 16 {
            return;
        }
        let pace = took.as_secs_f64() / tokens as f64;
        self.prefill_pace = Some(match self.prefill_pace {
            Some(p) => 0.75 * p + 0.25 * pace,
            None => pace,
        });
    }

    /// Gives up the streams of requests that no longer wait for them (aborted, failed,
    /// preempted or cache-lost before their first step).
    fn sweep_streams(&mut self) {
        let core = &self.core;
        self.streaming.retain(|id, s| {
            let keep = core.restore_pending(*id);
            if !keep {
                s.stream.fail(StreamFailure::Abandoned);
            }
            keep
        });
    }

    /// Registers the restored blocks when every rank wrote them into the caches that are
    /// still current, then admits the request (which takes them as its cached prefix).
    fn on_tiers_restored(&mut self, r: TierRestore) {
        let bs = self.core.config().block_size;
        let bm = self.core.block_manager().clone();
        if r.ok && self.worker_epochs() == r.epochs {
            let parent = r.first.checked_sub(1).map(|p| r.hashes[p]);
            let n = bm.register_run(
                &r.alloc,
                parent,
                &r.hashes[r.first..],
                &r.tokens[r.first * bs..],
                bs,
                &r.hits,
            );
            metrics::histogram!(pdserve_runtime::telemetry::KV_TIER_LOAD_SECONDS)
                .record(r.started.elapsed().as_secs_f64());
            tracing::debug!(request = %r.request.id, blocks = n, "restored KV blocks from the tiers");
        } else {
            tracing::warn!(request = %r.request.id, "a KV tier restore did not reach every rank: recomputing");
        }
        self.pins.push(r.pin);
        self.pins.push(r.alloc);
        if r.sink.is_closed() {
            return self.abandon(r.request.id, r.source); // the client left meanwhile
        }
        self.proceed(r.request, r.sink, r.source);
    }

    /// Has every rank copy the blocks the pool evicted since the last call out of its cache,
    /// ahead of anything that rewrites them, for the KV tiers. A step queued after this call
    /// runs after the copies (each rank's queue is in order).
    fn flush_spills(&mut self) {
        if let Some(evicted) = self.take_spill() {
            self.queue_spill(evicted, Box::new(|| {}));
        }
    }

    /// The blocks the pool evicted since the last call that the KV tiers take, when the ranks
    /// can copy them now (all up, the tiers' job queue not full); the others are counted as
    /// not spilled.
    fn take_spill(&mut self) -> Option<Vec<crate::block_manager::Evicted>> {
        let tiers = self.tiers.as_ref()?;
        let evicted = self.core.block_manager().take_evicted();
        let total = evicted.len();
        let evicted: Vec<_> = evicted
            .into_iter()
            .filter(|e| tiers.admits(e.hits) && !tiers.holds(e.hash))
            .collect();
        let filtered = total - evicted.len();
        if filtered > 0 {
            tiers.not_spilled(filtered);
        }
        if evicted.is_empty() {
            return None;
        }
        if !tiers.may_queue_jobs() || self.workers.iter().any(Option::is_none) {
            tiers.not_spilled(evicted.len());
            return None;
        }
        Some(evicted)
    }

    /// Queues the copy of `evicted` on every rank; `done` runs once every rank read them (or
    /// dropped its job), on the thread that finished last: from then on something off the
    /// ranks' queues (a KV transfer landing) may rewrite the blocks.
    fn queue_spill(&self, evicted: Vec<crate::block_manager::Evicted>, done: SpillDone) {
        let Some(tiers) = &self.tiers else {
            return done();
        };
        // An injected slow spill: its end is reported late, off the ranks (test-only).
        let done = match self.faults.as_ref().and_then(|f| f.spill()) {
            Some(delay) => Box::new(move || {
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    done();
                });
            }) as SpillDone,
            None => done,
        };
        let jobs = crate::kv_tiers::spill_jobs(tiers, evicted, done);
        for (job, w) in jobs.into_iter().zip(&self.workers) {
            if let Some((_, w)) = w {
                w.kv(job);
            }
        }
    }

    /// Whether request `id` waits for, or is receiving, its KV from a prefill instance.
    fn receiving_kv(&self, id: RequestId) -> bool {
        matches!(
            self.core.state(id),
            Some(RequestState::WaitingForRemoteKv | RequestState::Transferring)
        )
    }

    /// Sends a hand-off's fetch to the KvReceiver, unless its request ended meanwhile (while
    /// the ranks copied its destination blocks out): then the prefill side is told to drop
    /// the hand-off, and the fetch's blocks return to the pool with it.
    fn start_fetch(&mut self, fetch: Box<Fetch>) {
        let id = fetch.id;
        if !self.receiving_kv(id) {
            tracing::debug!(request = %id, "request gone before its KV fetch started");
            if let Some(r) = &self.kv_receiver {
                r.abandon(fetch.source);
            }
            return;
        }
        let sent = self.kv_receiver.as_ref().is_some_and(|r| r.fetch(fetch));
        if !sent {
            self.core.abort(id);
            self.dispatch(vec![Output::Failed {
                id,
                error: RequestError::KvTransfer(HandoffError::Interrupted(
                    "the KV receiver is gone".into(),
                )),
            }]);
        }
    }

    /// A request whose client left while its prefix loaded from the KV tiers, before it was
    /// admitted: a P/D request's prefill side is told to drop the hand-off (as when the
    /// client leaves during the KV fetch), so that it frees the blocks it holds for it at
    /// once rather than when their lease ends.
    fn abandon(&self, id: RequestId, source: Option<KvSource>) {
        metrics::counter!(pdserve_runtime::telemetry::REQUESTS_TOTAL, "outcome" => "aborted")
            .increment(1);
        let Some(source) = source else {
            tracing::debug!(request = %id, "client gone while its prefix loaded from the KV tiers");
            return;
        };
        tracing::info!(request = %id, transfer = %source.transfer(), "client gone while its prefix loaded from the KV tiers: aborting the hand-off");
        if let Some(r) = &self.kv_receiver {
            r.abandon(source);
        }
    }

    fn submit_remote(&mut self, request: NewRequest, sink: EventSink, source: KvSource) {
        let id = request.id;
        if self.kv_receiver.is_none() {
            let _ = sink.try_send(RequestEvent::Failed(RequestError::BadRequest(
                "this instance has no KV transfer engine: do_remote_prefill needs role decode"
                    .into(),
            )));
            return;
        }
        if let KvSource::Held { first_token, .. } = &source {
            if *first_token as usize >= self.vocab_size {
                let _ = sink.try_send(RequestEvent::Failed(RequestError::BadRequest(
                    "kv_transfer_params.first_token_id is outside the vocabulary".into(),
                )));
                return;
            }
        }
        let (prompt, params) = (request.prompt.clone(), request.params.clone());
        let images = image_refs(&request.images);
        let may_prefill_here = matches!(source, KvSource::Drive { .. });
        let admitted = self.core.add_remote(request, may_prefill_here);
        match admitted {
            Ok(RemoteAdmission::Local { cached_blocks }) => {
                // Prefix-aware conditional disaggregation: the uncached suffix is cheaper here
                // than a hand-off.
                tracing::info!(request = %id, transfer = %source.transfer(), cached_blocks, prompt_tokens = prompt.len(), "prefilling locally: the prefix cache holds the prompt");
                metrics::counter!(pdserve_runtime::telemetry::LOCAL_PREFILLS_TOTAL, pdserve_runtime::telemetry::LABEL_REASON => "prefix_hit").increment(1);
                metrics::counter!(pdserve_runtime::telemetry::PROMPT_TOKENS_TOTAL)
                    .increment(prompt.len() as u64);
                self.owners.insert(id, Owner::new(sink, None, None));
            }
            Ok(RemoteAdmission::Remote { cached_blocks, .. }) => {
                let blocks = self.core.share_blocks(id).expect("just added");
                let _ = self.core.remote_kv_transferring(id);
                let remote = Remote {
                    transfer: source.transfer(),
                    epochs: self
                        .worker_epochs()
                        .into_iter()
                        .map(|e| e.unwrap_or(0))
                        .collect(),
                    computed_at_unix_us: None,
                    stepped: false,
                };
                self.owners.insert(id, Owner::new(sink, None, Some(remote)));
                let me = self.me.clone();
                let fetch = Fetch {
                    id,
                    source,
                    blocks,
                    cached_blocks,
                    prompt,
                    params,
                    images,
                    reply: FetchReply::new(move |outcome| {
                        me.tell(
                            ActorKind::Scheduler,
                            "remote_kv_done",
                            SchedulerMsg::RemoteKvDone { id, outcome },
                        );
                    }),
                };
                // The blocks the destination evicted are written by the transfer, off the
                // ranks' queues: the fetch starts once the ranks copied them out for the KV
                // tiers.
                let fetch = Box::new(fetch);
                match self.take_spill() {
                    Some(evicted) => {
                        let me = self.me.clone();
                        self.queue_spill(
                            evicted,
                            Box::new(move || {
                                me.tell(
                                    ActorKind::Scheduler,
                                    "start_fetch",
                                    SchedulerMsg::StartFetch(fetch),
                                );
                            }),
                        );
                    }
                    None => self.start_fetch(fetch),
                }
            }
            Err(e) => {
                let _ = sink.try_send(RequestEvent::Failed(e));
            }
        }
    }

    /// Sends the upload of `blocks` (landed in the host mirrors) to every rank; the request
    /// decodes once all of them answered ([`SchedulerState::on_uploaded`]). Fails it at once
    /// when a rank is down.
    fn start_upload(
        &mut self,
        id: RequestId,
        blocks: Vec<u32>,
        mut pending: PendingUpload,
    ) -> Vec<Output> {
        let mut epochs = Vec::with_capacity(self.workers.len());
        for (rank, w) in self.workers.iter().enumerate() {
            let Some((epoch, worker)) = w else {
                return self.upload_failed(id, format!("TP rank {rank} is restarting"));
            };
            epochs.push((*epoch, worker.clone(), rank));
        }
        pending.epochs = epochs.iter().map(|(e, _, _)| *e).collect();
        pending.done = vec![false; epochs.len()];
        self.uploads.insert(id, pending);
        tracing::debug!(request = %id, blocks = blocks.len(), "uploading landed KV to the device");
        for (epoch, worker, rank) in epochs {
            let me = self.me.clone();
            let done: crate::worker::UploadCallback = Box::new(move |r| {
                me.tell(
                    ActorKind::Scheduler,
                    "kv_uploaded",
                    SchedulerMsg::KvUploaded {
                        id,
                        rank,
                        epoch,
                        result: r,
                    },
                );
            });
            if !worker.upload_kv(blocks.clone(), done) {
                // The worker is gone (its restart is reported as WorkerDown, which fails
                // the request).
                tracing::warn!(request = %id, rank, "KV upload not sent: the worker is gone");
            }
        }
        Vec::new()
    }

    /// One rank's upload of a request's landed KV ended.
    fn on_uploaded(
        &mut self,
        id: RequestId,
        rank: usize,
        epoch: u64,
        result: Result<(), ModelError>,
    ) -> Vec<Output> {
        let Some(p) = self.uploads.get_mut(&id) else {
            return Vec::new(); // failed or aborted meanwhile
        };
        if p.epochs.get(rank) != Some(&epoch) {
            return Vec::new();
        }
        if let Err(e) = result {
            self.uploads.remove(&id);
            return self.upload_failed(id, format!("TP rank {rank}: {e}"));
        }
        p.done[rank] = true;
        if !p.done.iter().all(|&d| d) {
            return Vec::new();
        }
        let p = self.uploads.remove(&id).expect("present");
        self.core
            .remote_kv_ready(
                id,
                p.first_token,
                p.first_logprobs,
                p.prefill_cached,
                Instant::now(),
            )
            .unwrap_or_default()
    }

    /// A request's landed KV could not be uploaded: it fails like a failed transfer (its
    /// blocks go back to the pool).
    fn upload_failed(&mut self, id: RequestId, reason: String) -> Vec<Output> {
        tracing::warn!(request = %id, %reason, "KV upload to the device failed");
        if self.core.abort(id) {
            vec![Output::Failed {
                id,
                error: RequestError::KvTransfer(HandoffError::Upload(reason)),
            }]
        } else {
            Vec::new()
        }
    }

    /// Each rank's worker epoch (`None` while it is down).
    fn worker_epochs(&self) -> Vec<Option<u64>> {
        self.workers
            .iter()
            .map(|w| w.as_ref().map(|(e, _)| *e))
            .collect()
    }

    /// Drops a request; one whose KV is still arriving has its hand-off stopped too (the
    /// receiver tells the prefill side). Returns whether it existed.
    fn abort_request(&mut self, id: RequestId) -> bool {
        self.uploads.remove(&id);
        if self.receiving_kv(id) {
            if let Some(r) = &self.kv_receiver {
                r.abort(id);
            }
        }
        if let Some(s) = self.streaming.remove(&id) {
            s.stream.fail(StreamFailure::Abandoned);
        }
        self.core.abort(id)
    }

    /// A step ended without completing: the KvSender stops waiting for its layers.
    fn step_failed(&self, step_id: u64, pushes: bool) {
        if pushes {
            if let Some(sender) = &self.kv_sender {
                sender.event(PushEvent::StepFailed(step_id));
            }
        }
    }

    fn on_step_done(
        &mut self,
        epoch: u64,
        step_id: u64,
        rank: usize,
        result: Result<Vec<Vec<f32>>, StepError>,
    ) {
        let current_epoch = self
            .workers
            .get(rank)
            .and_then(|w| w.as_ref().map(|(e, _)| *e));
        if current_epoch != Some(epoch) {
            tracing::debug!(rank, epoch, step_id, "dropping a report from an old epoch");
            return;
        }
        let Some(inf) = self
            .in_flight
            .as_mut()
            .filter(|i| i.plan.step_id == step_id)
        else {
            // A reply to a step that already failed: that rank has left the collective.
            self.draining[rank] = false;
            return;
        };
        if inf.replies[rank].is_some() {
            return; // duplicate report: counted once by rank index
        }
        inf.replies[rank] = Some(result);
        if inf.replies.iter().any(Option::is_none) {
            return;
        }
        let mut inf = self.in_flight.take().expect("checked above");
        let mut logits = None;
        let mut failure = None;
        for (r, reply) in inf.replies.into_iter().enumerate() {
            match reply.expect("all present") {
                Ok(l) if r == 0 => logits = Some(l),
                Ok(_) => {}
                Err(e) => failure = failure.or(Some(format!("TP rank {r}: {e}"))),
            }
        }
        let restores = std::mem::take(&mut inf.plan.restores);
        let out = match (failure, logits) {
            (None, Some(l)) => {
                self.note_prefill_pace(&inf.plan, inf.sent.elapsed());
                self.settle_restores(&restores);
                self.core.complete(inf.plan, l, Instant::now())
            }
            (Some(e), _) => {
                self.needs_reset = true;
                self.step_failed(inf.plan.step_id, inf.pushes);
                self.core.fail_step(inf.plan, RequestError::WorkerFailed(e))
            }
            (None, None) => self.core.fail_step(
                inf.plan,
                RequestError::Internal("no logits from rank 0".into()),
            ),
        };
        self.sweep_streams();
        self.dispatch(out);
    }

    fn maybe_step(&mut self) {
        if self.in_flight.is_some()
            || self.workers.iter().any(Option::is_none)
            || !self.core.has_work()
        {
            return;
        }
        if self.draining.iter().any(|&d| d) {
            return;
        }
        if std::mem::take(&mut self.needs_reset) {
            self.collective.reset();
        }
        let Some(plan) = self.core.schedule() else {
            return;
        };
        // The blocks this plan evicted are copied out before the step rewrites them.
        self.flush_spills();
        self.note_first_decode_steps(&plan);
        let batch: Arc<Batch> = Arc::new(plan.batch.clone());
        let hook = self.push_hook(&plan);
        let feed = self.restore_feed(&plan);
        for (_, w) in self.workers.iter().flatten() {
            w.step(plan.step_id, batch.clone(), hook.clone(), feed.clone());
        }
        // The workers compute the step's logits now: meanwhile, the grammar masks they will
        // need (structured output), so sampling only applies them.
        self.core.prepare_masks(&plan);
        self.in_flight = Some(InFlight {
            sent: Instant::now(),
            replies: vec![None; self.workers.len()],
            pushes: hook.is_some(),
            plan,
        });
    }

    /// The hand-off gap of remote requests whose first decode step `plan` holds: from the
    /// prefill instance having the prompt computed to now.
    fn note_first_decode_steps(&mut self, plan: &StepPlan) {
        use pdserve_runtime::telemetry as m;
        for (id, _, _) in &plan.members {
            let Some(remote) = self.owners.get_mut(id).and_then(|o| o.remote.as_mut()) else {
                continue;
            };
            if std::mem::replace(&mut remote.stepped, true) {
                continue;
            }
            let at_us = unix_now_us();
            let transfer = remote.transfer;
            tracing::info!(%transfer, at_us, "handoff: first decode step");
            if let Some(computed) = remote.computed_at_unix_us {
                let gap = at_us.saturating_sub(computed) as f64 / 1e6;
                metrics::histogram!(m::KV_HANDOFF_GAP_SECONDS).record(gap);
            }
        }
    }

    /// When `plan` computes chunks of pushed requests: tells the KvSender (before any worker
    /// gets the step) and returns the layer hook every rank calls as each layer's K/V land in
    /// its cache.
    fn push_hook(&self, plan: &StepPlan) -> Option<pdserve_gpu::tp::LayerHook> {
        let sender = self.kv_sender.clone()?;
        let chunks: Vec<PushChunk> = self
            .core
            .push_chunks(plan)
            .into_iter()
            .map(|(transfer, blocks, start, end)| PushChunk {
                transfer,
                blocks,
                start,
                end,
            })
            .collect();
        if chunks.is_empty() {
            return None;
        }
        let epochs: Vec<u64> = self
            .workers
            .iter()
            .map(|w| w.as_ref().map_or(0, |(e, _)| *e))
            .collect();
        let step_id = plan.step_id;
        let sent = sender.event(PushEvent::Step {
            step_id,
            epochs: epochs.clone(),
            chunks,
        });
        if !sent {
            return None;
        }
        Some(Arc::new(move |rank, layer| {
            sender.event(PushEvent::LayerDone {
                step_id,
                rank,
                epoch: epochs.get(rank).copied().unwrap_or(0),
                layer,
            });
        }))
    }

    fn dispatch(&mut self, outputs: Vec<Output>) {
        use pdserve_runtime::telemetry as m;
        for o in outputs {
            let (id, event, end) = match o {
                Output::Token {
                    id,
                    token,
                    text,
                    logprobs,
                } => (
                    id,
                    RequestEvent::Token {
                        token,
                        text,
                        logprobs,
                    },
                    false,
                ),
                Output::PromptLogprobs { id, logprobs } => {
                    (id, RequestEvent::PromptLogprobs(logprobs), false)
                }
                Output::Finished {
                    id,
                    reason,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    held_blocks,
                } => {
                    metrics::counter!(m::REQUESTS_TOTAL, "outcome" => "finished").increment(1);
                    let usage = crate::openai::Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    };
                    (
                        id,
                        RequestEvent::Finished {
                            reason,
                            text,
                            usage,
                            held_blocks,
                        },
                        true,
                    )
                }
                Output::Failed { id, error } => {
                    metrics::counter!(m::REQUESTS_TOTAL, "outcome" => error.kind()).increment(1);
                    (id, RequestEvent::Failed(error), true)
                }
            };
            let Some(owner) = self.owners.get_mut(&id) else {
                continue;
            };
            if let RequestEvent::Token { .. } = event {
                let now = Instant::now();
                metrics::counter!(m::GENERATED_TOKENS_TOTAL).increment(1);
                match owner.last_token {
                    None => metrics::histogram!(m::TIME_TO_FIRST_TOKEN_SECONDS)
                        .record(now.duration_since(owner.arrived).as_secs_f64()),
                    Some(prev) => metrics::histogram!(m::INTER_TOKEN_LATENCY_SECONDS)
                        .record(now.duration_since(prev).as_secs_f64()),
                }
                owner.first_token.get_or_insert(now);
                owner.last_token = Some(now);
            }
            if let RequestEvent::Finished { usage, .. } = &event {
                if let (Some(first), Some(last)) = (owner.first_token, owner.last_token) {
                    if usage.completion_tokens > 1 {
                        let tpot = last.duration_since(first).as_secs_f64()
                            / (usage.completion_tokens - 1) as f64;
                        metrics::histogram!(m::TIME_PER_OUTPUT_TOKEN_SECONDS).record(tpot);
                    }
                }
            }
            if let (
                Some(transfer),
                RequestEvent::Finished {
                    held_blocks: Some(_),
                    ..
                },
            ) = (owner.hold_for, &event)
            {
                tracing::info!(%transfer, at_us = unix_now_us(), "handoff: prompt computed");
            }
            let gone = match owner.sink.try_send(event) {
                Ok(()) => false,
                Err(TrySendError::Closed(_)) => true,
                Err(TrySendError::Full(_)) => {
                    // Cannot happen: the channel holds every event a request can produce.
                    tracing::error!(request = %id, "request event channel full: dropping the request");
                    true
                }
            };
            if end {
                self.owners.remove(&id);
            } else if gone {
                // The owner went away (client disconnect): stop spending compute on it.
                self.abort_request(id);
                self.owners.remove(&id);
                metrics::counter!(m::REQUESTS_TOTAL, "outcome" => "aborted").increment(1);
            }
        }
    }

    fn publish_gauges(&self) {
        use pdserve_runtime::telemetry as m;
        let s = self.core.stats();
        metrics::gauge!(m::REQUESTS_WAITING).set(s.waiting as f64);
        metrics::gauge!(m::REQUESTS_RUNNING).set(s.running as f64);
        metrics::gauge!(m::KV_BLOCKS_FREE).set(s.blocks_free as f64);
        metrics::gauge!(m::KV_BLOCKS_USED).set((s.blocks_total - s.blocks_free) as f64);
        metrics::counter!(m::PREEMPTIONS_TOTAL).absolute(s.preemptions);
        metrics::gauge!(m::KV_BLOCKS_CACHED).set(s.blocks_cached as f64);
        metrics::counter!(m::PREFIX_CACHE_EVICTIONS_TOTAL).absolute(s.cache_evictions);
        metrics::counter!(m::PREFIX_CACHE_QUERY_TOKENS_TOTAL).absolute(s.prompt_tokens);
        metrics::counter!(m::PREFIX_CACHE_HIT_TOKENS_TOTAL).absolute(s.prompt_tokens_cached);
    }
}

/// A prompt's images as the peer protocol references them (position, digest, rows): what a
/// decode instance driving its prefill sends instead of the embeddings.
fn image_refs(images: &[PromptImage]) -> Vec<crate::handoff::protocol::ImageRef> {
    images
        .iter()
        .map(|i| crate::handoff::protocol::ImageRef {
            at: i.at as u32,
            digest: i.embeds.digest.0,
            rows: i.embeds.rows as u32,
        })
        .collect()
}
