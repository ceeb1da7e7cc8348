//! The Scheduler actor: owns the request queues and the KV block pool of one instance
//! ([`SchedulerCore`]), plans one forward step at a time, sends it to every TpWorker, joins
//! their reports (by rank index, per step id and epoch) and streams tokens to each request's
//! owner.
//!
//! Messages: [`SchedulerMsg`]. Supervised by the `InstanceSupervisor`, which reports worker
//! failures (`WorkerDown`) and restarts (`WorkerUp`). When a worker fails, every request in the
//! step it was running ends with a 5xx [`RequestError::WorkerFailed`] and its blocks return to
//! the pool; scheduling resumes once every rank is back. If the Scheduler itself fails, the
//! supervisor escalates: the requests it held cannot be recovered.

mod core;

pub use self::core::{
    NewRequest, Output, RequestState, SchedulerConfig, SchedulerCore, SchedulerStats, StepPlan,
};

use crate::error::RequestError;
use crate::kv_receiver::{KvReceiverMsg, KvSource};
use crate::kv_sender::{KvSenderMsg, PushChunk};
use crate::mailbox::{Inbox, Mailbox};
use crate::worker::WorkerMsg;
use pdserve_gpu::model::Batch;
use pdserve_gpu::sampling::FinishReason;
use pdserve_runtime::ids::{RequestId, TransferId};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What a request's owner (an HTTP handler) receives.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// A token and the text that became final with it.
    Token {
        /// Token id.
        token: u32,
        /// Text (possibly empty).
        text: String,
    },
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Last text.
        text: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
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
        sink: UnboundedSender<RequestEvent>,
    },
    /// A request whose prompt KV comes from a prefill instance (decode side of P/D).
    SubmitRemote {
        /// The request (its prompt is what the prefill side computed).
        request: NewRequest,
        /// Where its events go.
        sink: UnboundedSender<RequestEvent>,
        /// Where the KV comes from.
        source: KvSource,
    },
    /// The KvReceiver finished (or failed) bringing a request's KV in.
    RemoteKvDone {
        /// Request.
        id: RequestId,
        /// T0 from the prefill side, or the failure.
        result: Result<u32, String>,
        /// The KV cache generation the bytes landed in (see `KvRegistry::generation`).
        generation: u64,
    },
    /// A decode instance renews the leases of blocks held for it; answers the transfers no
    /// longer held.
    RenewHeld(Vec<TransferId>, RpcReplyPort<Vec<TransferId>>),
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
    /// A rank finished (or failed) a step.
    StepDone {
        /// The reporting worker's epoch.
        epoch: u64,
        /// Which step.
        step_id: u64,
        /// Which rank.
        rank: usize,
        /// Logits (rank 0) or the failure.
        result: Result<Vec<Vec<f32>>, String>,
    },
    /// A worker died; its supervisor is restarting it.
    WorkerDown {
        /// Rank.
        rank: usize,
        /// What happened.
        reason: String,
    },
    /// A worker (re)started and is ready for steps.
    WorkerUp {
        /// Rank.
        rank: usize,
        /// Its epoch (stale reports from older epochs are dropped).
        epoch: u64,
        /// Where to send steps.
        worker: Mailbox<WorkerMsg>,
    },
    /// Queue and pool figures.
    Stats(RpcReplyPort<SchedulerStats>),
}

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
    pub kv_receiver: Option<Mailbox<KvReceiverMsg>>,
    /// The KV sender (instances with a transfer engine).
    pub kv_sender: Option<Mailbox<KvSenderMsg>>,
    /// The registry whose generation tells whether received KV is still in the cache.
    pub kv_generation: Option<Arc<crate::kv_receiver::KvRegistry>>,
    /// Vocabulary size (validates peer-supplied first tokens).
    pub vocab_size: usize,
}

struct InFlight {
    plan: StepPlan,
    /// Whether the KvSender was told about pushed chunks of this step.
    pushes: bool,
    replies: Vec<Option<Result<Vec<Vec<f32>>, String>>>,
}

struct Owner {
    sink: UnboundedSender<RequestEvent>,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// The Scheduler's mutable state.
pub struct SchedulerState {
    core: SchedulerCore,
    owners: HashMap<RequestId, Owner>,
    workers: Vec<Option<(u64, Mailbox<WorkerMsg>)>>,
    in_flight: Option<InFlight>,
    /// Ranks that still owe a reply to a step that failed: the collective is reset only when
    /// none is left inside it.
    draining: Vec<bool>,
    collective: pdserve_gpu::collective::ThreadCollective,
    needs_reset: bool,
    kv_receiver: Option<Mailbox<KvReceiverMsg>>,
    kv_sender: Option<Mailbox<KvSenderMsg>>,
    me: Mailbox<SchedulerMsg>,
    kv_generation: Option<Arc<crate::kv_receiver::KvRegistry>>,
    vocab_size: usize,
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
        let ticker = me.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                if ticker.cast(SchedulerMsg::Tick).is_err() {
                    break; // stopped
                }
            }
        });
        Ok(SchedulerState {
            me,
            core: SchedulerCore::new(args.config, args.tokenizer),
            owners: HashMap::new(),
            workers: vec![None; args.tp],
            in_flight: None,
            draining: vec![false; args.tp],
            collective: args.collective,
            needs_reset: false,
            kv_receiver: args.kv_receiver,
            kv_sender: args.kv_sender,
            kv_generation: args.kv_generation,
            vocab_size: args.vocab_size,
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
                st.submit_remote(request, sink, source);
            }
            SchedulerMsg::RemoteKvDone {
                id,
                result,
                generation,
            } => {
                // KV that landed in a cache a restarted worker has replaced is gone; so is KV
                // landing while a worker is down (its replacement allocates a fresh cache).
                let cache_intact = st.workers.iter().all(Option::is_some)
                    && st
                        .kv_generation
                        .as_ref()
                        .is_none_or(|g| g.generation() == generation);
                let result = match result {
                    Ok(_) if !cache_intact => {
                        Err("a TP worker restarted while this request's KV was arriving"
                            .to_string())
                    }
                    r => r,
                };
                let out = match result {
                    // An abort while the KV was landing leaves nothing to resume.
                    Ok(first_token) => st.core.remote_kv_ready(id, first_token).unwrap_or_default(),
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
                            let _ = owner.sink.send(RequestEvent::Failed(RequestError::Aborted));
                        }
                        true
                    }
                    None => st.core.release_held(transfer),
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
                st.core.expire_held(Instant::now());
            }
            SchedulerMsg::Submit { request, sink } => {
                let id = request.id;
                let prompt_tokens = request.prompt.len();
                match st.core.add(request) {
                    Ok(()) => {
                        metrics::counter!(pdserve_runtime::telemetry::PROMPT_TOKENS_TOTAL)
                            .increment(prompt_tokens as u64);
                        st.owners.insert(
                            id,
                            Owner {
                                sink,
                                arrived: Instant::now(),
                                first_token: None,
                                last_token: None,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = sink.send(RequestEvent::Failed(e));
                    }
                }
            }
            SchedulerMsg::Abort(id) => {
                if st.abort_request(id) {
                    tracing::debug!(request = %id, "aborted by its owner");
                    metrics::counter!(pdserve_runtime::telemetry::REQUESTS_TOTAL, "outcome" => "aborted").increment(1);
                }
                st.owners.remove(&id);
            }
            SchedulerMsg::StepDone {
                epoch,
                step_id,
                rank,
                result,
            } => {
                st.on_step_done(epoch, step_id, rank, result);
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
                        let _ = w.cast(WorkerMsg::Poison(reason.clone()));
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
                    st.abort_request(id);
                    out.push(Output::Failed {
                        id,
                        error: RequestError::WorkerFailed(format!(
                            "TP rank {rank} restarted while this request's KV was arriving"
                        )),
                    });
                }
                st.core.cache_lost();
                st.dispatch(out);
            }
            SchedulerMsg::WorkerUp {
                rank,
                epoch,
                worker,
            } => {
                st.workers[rank] = Some((epoch, worker));
            }
            SchedulerMsg::Stats(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(st.core.stats());
                }
            }
        }
        st.maybe_step();
        st.publish_gauges();
        Ok(())
    }
}

impl SchedulerState {
    fn submit_remote(
        &mut self,
        request: NewRequest,
        sink: UnboundedSender<RequestEvent>,
        source: KvSource,
    ) {
        let id = request.id;
        let Some(receiver) = self.kv_receiver.clone() else {
            let _ = sink.send(RequestEvent::Failed(RequestError::BadRequest(
                "this instance has no KV transfer engine: do_remote_prefill needs role decode"
                    .into(),
            )));
            return;
        };
        if let KvSource::Held(remote) = &source {
            if remote.first_token as usize >= self.core_vocab() {
                let _ = sink.send(RequestEvent::Failed(RequestError::BadRequest(
                    "kv_transfer_params.first_token_id is outside the vocabulary".into(),
                )));
                return;
            }
        }
        let (prompt, params) = (request.prompt.clone(), request.params.clone());
        match self.core.add_remote(request) {
            Ok(_) => {
                let blocks = self.core.share_blocks(id).expect("just added");
                let _ = self.core.remote_kv_transferring(id);
                self.owners.insert(
                    id,
                    Owner {
                        sink,
                        arrived: Instant::now(),
                        first_token: None,
                        last_token: None,
                    },
                );
                if receiver
                    .cast(KvReceiverMsg::Fetch(Box::new(crate::kv_receiver::Fetch {
                        id,
                        source,
                        blocks,
                        prompt,
                        params,
                        reply: crate::kv_receiver::FetchReply::new(id, self.me.clone()),
                    })))
                    .is_err()
                {
                    self.core.abort(id);
                    self.dispatch(vec![Output::Failed {
                        id,
                        error: RequestError::Internal("the KV receiver is gone".into()),
                    }]);
                }
            }
            Err(e) => {
                let _ = sink.send(RequestEvent::Failed(e));
            }
        }
    }

    /// Drops a request; one whose KV is still arriving has its hand-off stopped too (the
    /// receiver tells the prefill side). Returns whether it existed.
    fn abort_request(&mut self, id: RequestId) -> bool {
        let receiving = matches!(
            self.core.state(id),
            Some(RequestState::WaitingForRemoteKv | RequestState::Transferring)
        );
        if receiving {
            if let Some(r) = &self.kv_receiver {
                let _ = r.cast(KvReceiverMsg::Abort(id));
            }
        }
        self.core.abort(id)
    }

    /// A step ended without completing: the KvSender stops waiting for its layers.
    fn step_failed(&self, step_id: u64, pushes: bool) {
        if pushes {
            if let Some(sender) = &self.kv_sender {
                let _ = sender.cast(KvSenderMsg::StepFailed(step_id));
            }
        }
    }

    fn core_vocab(&self) -> usize {
        self.vocab_size
    }

    fn on_step_done(
        &mut self,
        epoch: u64,
        step_id: u64,
        rank: usize,
        result: Result<Vec<Vec<f32>>, String>,
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
        let inf = self.in_flight.take().expect("checked above");
        let mut logits = None;
        let mut failure = None;
        for (r, reply) in inf.replies.into_iter().enumerate() {
            match reply.expect("all present") {
                Ok(l) if r == 0 => logits = Some(l),
                Ok(_) => {}
                Err(e) => failure = failure.or(Some(format!("TP rank {r}: {e}"))),
            }
        }
        let out = match (failure, logits) {
            (None, Some(l)) => self.core.complete(inf.plan, l),
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
        let batch: Arc<Batch> = Arc::new(plan.batch.clone());
        let hook = self.push_hook(&plan);
        for (_, w) in self.workers.iter().flatten() {
            let _ = w.cast(WorkerMsg::Step {
                step_id: plan.step_id,
                batch: batch.clone(),
                hook: hook.clone(),
            });
        }
        self.in_flight = Some(InFlight {
            replies: vec![None; self.workers.len()],
            pushes: hook.is_some(),
            plan,
        });
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
        sender
            .cast(KvSenderMsg::Step {
                step_id,
                epochs: epochs.clone(),
                chunks,
            })
            .ok()?;
        Some(Arc::new(move |rank, layer| {
            let _ = sender.cast(KvSenderMsg::LayerDone {
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
                Output::Token { id, token, text } => {
                    (id, RequestEvent::Token { token, text }, false)
                }
                Output::Finished {
                    id,
                    reason,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    held_blocks,
                } => {
                    metrics::counter!(m::REQUESTS_TOTAL, "outcome" => "finished").increment(1);
                    (
                        id,
                        RequestEvent::Finished {
                            reason,
                            text,
                            prompt_tokens,
                            completion_tokens,
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
            if let RequestEvent::Finished {
                completion_tokens, ..
            } = &event
            {
                if let (Some(first), Some(last)) = (owner.first_token, owner.last_token) {
                    if *completion_tokens > 1 {
                        let tpot = last.duration_since(first).as_secs_f64()
                            / (*completion_tokens - 1) as f64;
                        metrics::histogram!(m::TIME_PER_OUTPUT_TOKEN_SECONDS).record(tpot);
                    }
                }
            }
            let gone = owner.sink.send(event).is_err();
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
    }
}
