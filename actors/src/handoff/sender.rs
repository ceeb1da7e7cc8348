//! The KvSender actor: the prefill side's layerwise push hand-offs.
//!
//! In push mode a decode instance allocates the destination blocks first and sends their ids
//! with the prompt (a [`PrefillRequest`](super::protocol::PrefillRequest) in push mode). The
//! [`PeerService`](super::service::PeerService) validates the decode side's layout against
//! ours (the handshake), opens a transfer session and registers the hand-off here
//! ([`KvSenderMsg::Open`]). The Scheduler then tells us, before each forward step, which
//! chunks of which pushed requests the step computes ([`PushEvent::Step`]), and every TP
//! rank's layer hook reports each layer as soon as its K/V are in the rank's cache
//! ([`PushEvent::LayerDone`]). The decisions — which blocks of which rank go where, when a
//! rank's share is done, when a failed hand-off may close — are the [`PushTracker`]'s; this
//! actor performs them: writes run on the transport's executor (one tracked task per batch,
//! answering [`PushEvent::WriteDone`]), reports go to the Aggregator, outcomes to the
//! service. The mailbox never waits.
//!
//! Supervised by the `InstanceSupervisor`, which restarts it (and moves every rank's
//! hand-off epoch on). The hand-offs the failed incarnation had open end with it: their
//! outcome channels close, and the service answers decode only after the writes still in
//! flight can no longer land (one transfer bound, see [`KvContext`]).

use super::aggregator::{AggregatorHandle, HandoffOutcome, Tag};
use super::context::KvContext;
use super::protocol::{HandoffError, TransferFailure};
use super::push::{PushAction, PushEvent, PushShape, PushTarget, PushTracker};
use super::session::{fence_id, submit_ops};
use crate::mailbox::{Inbox, Mailbox};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::supervision::ActorKind;
use pdserve_runtime::telemetry as m;
use pdserve_transport::{FenceId, Session};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Messages of the KvSender.
pub enum KvSenderMsg {
    /// A push hand-off opens; `done` gets its outcome once, after its last write finished.
    Open {
        /// Where the KV goes.
        target: Arc<PushTarget>,
        /// The open session to the decode instance's transfer engine.
        session: Arc<Session>,
        /// The outcome.
        done: oneshot::Sender<HandoffOutcome>,
    },
    /// An event for the tracker as it is: a step about to run (from the Scheduler), a layer
    /// in a rank's cache (from its layer hook), a failed step, an ended write batch.
    Event(PushEvent),
    /// Give up on a hand-off (the request failed or was aborted).
    Cancel {
        /// The hand-off.
        transfer: TransferId,
        /// Why.
        reason: HandoffError,
        /// Answered once no write of the hand-off is in flight any more.
        drained: Option<oneshot::Sender<()>>,
    },
}

/// The KvSender's typed address, for the Scheduler, the peer service and the ranks' layer
/// hooks.
#[derive(Clone, Debug)]
pub struct KvSenderHandle(Mailbox<KvSenderMsg>);

impl KvSenderHandle {
    /// The handle of the KvSender behind `mailbox`.
    pub fn new(mailbox: Mailbox<KvSenderMsg>) -> Self {
        Self(mailbox)
    }

    /// Opens a push hand-off; `done` gets its outcome once, after its last write finished.
    ///
    /// # Errors
    /// [`HandoffError::Interrupted`] when the KvSender is gone.
    pub fn open(
        &self,
        target: Arc<PushTarget>,
        session: Arc<Session>,
        done: oneshot::Sender<HandoffOutcome>,
    ) -> Result<(), HandoffError> {
        let msg = KvSenderMsg::Open {
            target,
            session,
            done,
        };
        if self.0.tell(ActorKind::KvSender, "open", msg) {
            Ok(())
        } else {
            Err(HandoffError::Interrupted("the KV sender is gone".into()))
        }
    }

    /// An event for the tracker. Returns whether it was queued; a KvSender that is gone
    /// failed its hand-offs with it (their `done` closed).
    pub fn event(&self, event: PushEvent) -> bool {
        self.0
            .tell(ActorKind::KvSender, "event", KvSenderMsg::Event(event))
    }

    /// Gives up on a hand-off; `drained` is answered once none of its writes is in flight
    /// (dropped unanswered, so at once, when the KvSender is gone: its writes went with it).
    pub fn cancel(
        &self,
        transfer: TransferId,
        reason: HandoffError,
        drained: Option<oneshot::Sender<()>>,
    ) {
        let msg = KvSenderMsg::Cancel {
            transfer,
            reason,
            drained,
        };
        self.0.tell(ActorKind::KvSender, "cancel", msg);
    }
}

/// The KvSender's state: the tracker and the I/O handles of its hand-offs.
pub struct SenderState {
    kv: Arc<KvContext>,
    aggregator: AggregatorHandle,
    me: KvSenderHandle,
    tracker: PushTracker,
    sessions: HashMap<TransferId, PushSession>,
    done: HashMap<TransferId, oneshot::Sender<HandoffOutcome>>,
    drained: HashMap<TransferId, Vec<oneshot::Sender<()>>>,
}

/// The session a push writes on, and the fence its writes carry (when the target fenced the
/// destination blocks).
struct PushSession {
    session: Arc<Session>,
    fence: Option<FenceId>,
    peer_addr: String,
}

/// The KvSender actor (its mailbox count).
#[derive(Debug)]
pub struct KvSender(pub Inbox);

impl Drop for SenderState {
    /// A failed incarnation's open hand-offs are no longer in flight here (their waiters see
    /// their outcome channels close).
    fn drop(&mut self) {
        let open = self.tracker.open();
        if open == 0 {
            return;
        }
        let gone = HandoffError::Interrupted("the KV sender failed".into());
        for _ in 0..open {
            self.kv.handoff_ended(Err(&gone));
        }
        // Their writes may still be in flight: nobody can confirm they drained before the
        // transfer bound has passed (see `Cancel` for a hand-off the next incarnation does
        // not know).
        self.kv
            .orphan_writes_until(Instant::now() + self.kv.bounds().transfer);
    }
}

impl Actor for KvSender {
    type Msg = KvSenderMsg;
    type State = SenderState;
    type Arguments = (Arc<KvContext>, AggregatorHandle);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (kv, aggregator): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let shape = PushShape {
            num_layers: kv.settings.model.num_layers,
            block_size: kv.settings.block_size,
            tp: kv.settings.tp,
        };
        Ok(SenderState {
            kv,
            aggregator,
            me: KvSenderHandle::new(Mailbox::of(&myself, &self.0)),
            tracker: PushTracker::new(shape),
            sessions: HashMap::new(),
            done: HashMap::new(),
            drained: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        let now = Instant::now();
        let actions = match msg {
            KvSenderMsg::Open {
                target,
                session,
                done,
            } => {
                st.kv.handoff_started();
                let fence = target
                    .fenced(st.kv.security())
                    .then(|| fence_id(target.transfer));
                st.sessions.insert(
                    target.transfer,
                    PushSession {
                        session,
                        fence,
                        peer_addr: target.peer.transfer_addr.clone(),
                    },
                );
                st.done.insert(target.transfer, done);
                st.tracker.on(
                    PushEvent::Open {
                        target,
                        ours: st.kv.info(),
                        attempt: super::aggregator::next_attempt(),
                    },
                    now,
                )
            }
            KvSenderMsg::Event(event) => {
                if let PushEvent::WriteDone {
                    result: Ok(bytes), ..
                } = &event
                {
                    st.kv.sent(*bytes);
                }
                st.tracker.on(event, now)
            }
            KvSenderMsg::Cancel {
                transfer,
                reason,
                drained,
            } => {
                if let Some(d) = drained {
                    st.drained.entry(transfer).or_default().push(d);
                }
                st.tracker.on(PushEvent::Cancel { transfer, reason }, now)
            }
        };
        st.perform(actions);
        Ok(())
    }
}

impl SenderState {
    fn perform(&mut self, actions: Vec<PushAction>) {
        for action in actions {
            match action {
                PushAction::Expect {
                    transfer,
                    attempt,
                    epochs,
                } => {
                    let Some(done) = self.done.remove(&transfer) else {
                        continue;
                    };
                    let epochs = epochs.iter().map(|&e| self.kv.epochs.tag(e)).collect();
                    // With the Aggregator gone, `done` is dropped: the hand-off fails.
                    let _ = self.aggregator.expect(transfer, attempt, epochs, done);
                }
                PushAction::Write {
                    transfer,
                    rank,
                    mut ops,
                } => {
                    let (me, kv) = (self.me.clone(), self.kv.clone());
                    let session = self
                        .sessions
                        .get(&transfer)
                        .map(|s| (s.session.clone(), s.fence));
                    self.kv.tasks.spawn(async move {
                        let bound = kv.bounds().transfer;
                        let result = match (session, kv.transfer_fault(&mut ops).await) {
                            (_, Err(e)) => Err(e),
                            (None, Ok(())) => Err(HandoffError::Interrupted(
                                "no transfer session for the hand-off".into(),
                            )),
                            (Some((session, fence)), Ok(())) => {
                                match submit_ops(&session, fence, &ops).await {
                                    Ok(batch) => batch
                                        .wait(bound)
                                        .await
                                        .map(|()| batch.bytes())
                                        .map_err(|e| HandoffError::transfer(&e)),
                                    Err(e) => Err(e),
                                }
                            }
                        };
                        me.event(PushEvent::WriteDone {
                            transfer,
                            rank,
                            result,
                        });
                    });
                }
                PushAction::Report {
                    transfer,
                    rank,
                    tag,
                    report,
                } => {
                    let tag = Tag {
                        attempt: tag.attempt,
                        epoch: self.kv.epochs.tag(tag.epoch),
                    };
                    self.aggregator.report(transfer, rank, tag, report);
                }
                PushAction::FailUnopened { transfer, error } => {
                    if let Some(done) = self.done.remove(&transfer) {
                        let _ = done.send(Err(error));
                    }
                }
                PushAction::Closed {
                    transfer,
                    result,
                    bytes,
                    elapsed,
                } => {
                    let session = self.sessions.remove(&transfer);
                    self.done.remove(&transfer);
                    if let (Err(e), Some(s)) = (&result, session) {
                        if e.breaks_session() {
                            // The next push to that peer opens a new session.
                            self.kv.peers.forget_session(&s.peer_addr);
                        }
                    }
                    match &result {
                        Ok(()) => {
                            metrics::histogram!(m::KV_TRANSFER_SECONDS, m::LABEL_MODE => "push")
                                .record(elapsed.as_secs_f64());
                            tracing::info!(%transfer, bytes, ms = elapsed.as_millis() as u64, "KV pushed");
                        }
                        Err(e) => {
                            tracing::warn!(%transfer, kind = e.kind(), error = %e, "KV push failed");
                        }
                    }
                    self.kv.handoff_ended(result.as_ref().map(|_| ()));
                    for d in self.drained.remove(&transfer).unwrap_or_default() {
                        let _ = d.send(());
                    }
                }
                PushAction::Unknown { transfer } => {
                    let waiters = self.drained.remove(&transfer).unwrap_or_default();
                    if waiters.is_empty() {
                        continue;
                    }
                    // Unknown here; if a failed incarnation had it, its writes end within one
                    // transfer bound of that failure.
                    let until = self.kv.orphan_writes_deadline();
                    self.kv.tasks.spawn(async move {
                        if let Some(t) = until {
                            tokio::time::sleep_until(t.into()).await;
                        }
                        for d in waiters {
                            let _ = d.send(());
                        }
                    });
                }
            }
        }
    }
}
