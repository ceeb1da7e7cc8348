//! The prefill side's push hand-off: the KvSender actor.
//!
//! In push mode a decode instance allocates the destination blocks first and sends their ids
//! with the prompt (`POST /v1/kv/prefill`, see [`crate::http`]). The HTTP handler validates the
//! decode side's published layout against ours (the handshake), opens a transfer session and
//! registers the hand-off here ([`KvSenderMsg::Open`]); the Scheduler then tells us, before
//! each forward step, which chunks of which pushed requests the step computes
//! ([`KvSenderMsg::Step`]), and every TP rank's layer hook reports each layer as soon as its
//! K/V are in the rank's cache ([`KvSenderMsg::LayerDone`]). For every such layer we write the
//! blocks that hold only final KV (those the chunk completes, see
//! [`final_blocks`](crate::kv_transfer::final_blocks)) of that rank's heads to the decode
//! ranks that own them (heterogeneous TP), while the rank computes the next layer: the
//! transfer overlaps the rest of the forward pass.
//!
//! Each rank's share is done when the prompt's last chunk passed its last layer and its
//! writes completed; the [`Aggregator`](crate::aggregator) joins the ranks' reports and
//! answers the HTTP handler, which then sends T0 to decode and frees the prompt's blocks. A
//! failed write, a failed step or a cancel ends the hand-off with a failure, but only after
//! every write already submitted has finished: the decode side frees its destination blocks
//! when it gets our answer, so no byte may land after it. The source blocks are kept (a
//! share) until then too, so an abort or a preemption never lets them be reused under a
//! write. Writes run on the transport's executor; the mailbox never waits.
//!
//! Supervised by the `InstanceSupervisor`, which restarts it. The hand-offs the failed
//! incarnation had open end with it: their outcome channels close (the HTTP handler answers
//! decode with a failure only after the writes still in flight can no longer land, see
//! `kv_prefill`), and their in-flight count is given back.

use crate::aggregator::{AggregatorMsg, HandoffOutcome, RankReport};
use crate::block_manager::BlockAllocation;
use crate::kv_receiver::KvContext;
use crate::kv_transfer::{final_blocks, plan_slice, Direction, KvPeerInfo, Slice};
use crate::mailbox::{Inbox, Mailbox};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::telemetry as m;
use pdserve_transport::Session;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Where a pushed request's KV goes.
#[derive(Debug, Clone)]
pub struct PushTarget {
    /// The hand-off id both sides use.
    pub transfer: TransferId,
    /// The decode instance's published KV memory (validated).
    pub peer: KvPeerInfo,
    /// Its destination blocks for the prompt (checked against the prompt length).
    pub blocks: Vec<u32>,
    /// Prompt tokens.
    pub prompt_len: usize,
}

/// One chunk of a pushed request inside a forward step.
#[derive(Debug)]
pub struct PushChunk {
    /// The hand-off.
    pub transfer: TransferId,
    /// A share of the request's blocks (kept until the hand-off settles).
    pub blocks: BlockAllocation,
    /// First prompt position the step computes.
    pub start: usize,
    /// One past the last.
    pub end: usize,
}

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
    /// The Scheduler is about to run a step computing these chunks.
    Step {
        /// Step id.
        step_id: u64,
        /// Epoch of each rank's worker running it.
        epochs: Vec<u64>,
        /// The pushed chunks.
        chunks: Vec<PushChunk>,
    },
    /// A rank has layer `layer` of step `step_id` in its cache (from its layer hook).
    LayerDone {
        /// Step id.
        step_id: u64,
        /// Rank.
        rank: usize,
        /// Its epoch.
        epoch: u64,
        /// Layer.
        layer: usize,
    },
    /// The step failed: its remaining layers will not be reported.
    StepFailed(u64),
    /// A write batch finished.
    WriteDone {
        /// The hand-off.
        transfer: TransferId,
        /// The writing rank.
        rank: usize,
        /// Bytes written.
        bytes: u64,
        /// Outcome.
        result: Result<(), String>,
    },
    /// Give up on a hand-off (the request failed or was aborted).
    Cancel {
        /// The hand-off.
        transfer: TransferId,
        /// Why.
        reason: String,
        /// Answered once no write of the hand-off is in flight any more.
        drained: Option<oneshot::Sender<()>>,
    },
}

struct Push {
    target: Arc<PushTarget>,
    session: Arc<Session>,
    ours: KvPeerInfo,
    /// Until the first step: then handed to the Aggregator.
    done: Option<oneshot::Sender<HandoffOutcome>>,
    epochs: Vec<u64>,
    sources: Vec<BlockAllocation>,
    outstanding: Vec<usize>,
    complete: Vec<bool>,
    reported: Vec<bool>,
    failed: Option<String>,
    drained: Vec<oneshot::Sender<()>>,
    opened: Instant,
}

struct StepEntry {
    epochs: Vec<u64>,
    chunks: Vec<(TransferId, Vec<u32>, usize, usize)>,
    last_layer_seen: Vec<bool>,
}

/// The KvSender's state.
pub struct SenderState {
    kv: Arc<KvContext>,
    aggregator: Mailbox<AggregatorMsg>,
    me: Mailbox<KvSenderMsg>,
    pushes: HashMap<TransferId, Push>,
    steps: HashMap<u64, StepEntry>,
}

/// The KvSender actor (its mailbox count).
#[derive(Debug)]
pub struct KvSender(pub Inbox);

impl Drop for SenderState {
    /// A failed incarnation's open hand-offs are no longer in flight here (their waiters
    /// see their outcome channels close).
    fn drop(&mut self) {
        if self.pushes.is_empty() {
            return;
        }
        self.kv
            .in_flight
            .fetch_sub(self.pushes.len() as u64, Ordering::Relaxed);
        // Their writes may still be in flight: nobody can confirm they drained before the
        // transfer bound has passed (see `Cancel` for a hand-off the next incarnation does
        // not know).
        *self
            .kv
            .orphan_writes_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + self.kv.timeout);
    }
}

impl Actor for KvSender {
    type Msg = KvSenderMsg;
    type State = SenderState;
    type Arguments = (Arc<KvContext>, Mailbox<AggregatorMsg>);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (kv, aggregator): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(SenderState {
            kv,
            aggregator,
            me: Mailbox::of(&myself, &self.0),
            pushes: HashMap::new(),
            steps: HashMap::new(),
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
            KvSenderMsg::Open {
                target,
                session,
                done,
            } => {
                let tp = st.kv.tp;
                st.kv.in_flight.fetch_add(1, Ordering::Relaxed);
                st.pushes.insert(
                    target.transfer,
                    Push {
                        ours: st.kv.info(),
                        target,
                        session,
                        done: Some(done),
                        epochs: Vec::new(),
                        sources: Vec::new(),
                        outstanding: vec![0; tp],
                        complete: vec![false; tp],
                        reported: vec![false; tp],
                        failed: None,
                        drained: Vec::new(),
                        opened: Instant::now(),
                    },
                );
            }
            KvSenderMsg::Step {
                step_id,
                epochs,
                chunks,
            } => {
                let mut entry = StepEntry {
                    last_layer_seen: vec![false; epochs.len()],
                    epochs: epochs.clone(),
                    chunks: Vec::new(),
                };
                for c in chunks {
                    let Some(push) = st.pushes.get_mut(&c.transfer) else {
                        continue; // cancelled meanwhile: the share drops here
                    };
                    if let Some(done) = push.done.take() {
                        push.epochs = epochs.clone();
                        st.aggregator.cast(AggregatorMsg::Expect {
                            transfer: c.transfer,
                            epochs: epochs.clone(),
                            done,
                        })?;
                    }
                    entry
                        .chunks
                        .push((c.transfer, c.blocks.blocks().to_vec(), c.start, c.end));
                    push.sources.push(c.blocks);
                }
                if !entry.chunks.is_empty() {
                    st.steps.insert(step_id, entry);
                }
            }
            KvSenderMsg::LayerDone {
                step_id,
                rank,
                epoch,
                layer,
            } => st.on_layer(step_id, rank, epoch, layer),
            KvSenderMsg::StepFailed(step_id) => {
                st.steps.remove(&step_id);
            }
            KvSenderMsg::WriteDone {
                transfer,
                rank,
                bytes,
                result,
            } => {
                if let Some(push) = st.pushes.get_mut(&transfer) {
                    push.outstanding[rank] -= 1;
                    match result {
                        Ok(()) => {
                            st.kv.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
                            metrics::counter!(m::KV_TRANSFER_BYTES_TOTAL, m::LABEL_DIRECTION => "sent")
                                .increment(bytes);
                        }
                        Err(e) => {
                            push.failed.get_or_insert(e);
                        }
                    }
                    st.settle(transfer);
                }
            }
            KvSenderMsg::Cancel {
                transfer,
                reason,
                drained,
            } => match st.pushes.get_mut(&transfer) {
                Some(push) => {
                    push.failed.get_or_insert(reason);
                    push.drained.extend(drained);
                    st.settle(transfer);
                }
                None => {
                    if let Some(d) = drained {
                        // Unknown here; if a failed incarnation had it, its writes end
                        // within one transfer bound of that failure.
                        let until = *st
                            .kv
                            .orphan_writes_until
                            .lock()
                            .unwrap_or_else(|e| e.into_inner());
                        tokio::spawn(async move {
                            if let Some(t) = until {
                                tokio::time::sleep_until(t.into()).await;
                            }
                            let _ = d.send(());
                        });
                    }
                }
            },
        }
        Ok(())
    }
}

impl SenderState {
    fn on_layer(&mut self, step_id: u64, rank: usize, epoch: u64, layer: usize) {
        let last_layer = self.kv.model.num_layers - 1;
        let bs = self.kv.block_size;
        let Some(entry) = self.steps.get_mut(&step_id) else {
            return; // a step that failed
        };
        if entry.epochs.get(rank) != Some(&epoch) {
            tracing::debug!(
                step_id,
                rank,
                epoch,
                "dropping a layer report from an old epoch"
            );
            return;
        }
        let mut touched = Vec::new();
        for (transfer, local, start, end) in &entry.chunks {
            let Some(push) = self.pushes.get_mut(transfer) else {
                continue;
            };
            if push.failed.is_some() {
                continue;
            }
            let prompt_len = push.target.prompt_len;
            let slice = Slice {
                rank,
                layers: layer..layer + 1,
                blocks: final_blocks(*start, *end, prompt_len, bs),
            };
            if !slice.blocks.is_empty() {
                let ops = plan_slice(
                    &push.ours,
                    &push.target.peer,
                    local,
                    &push.target.blocks,
                    &slice,
                    Direction::Write,
                );
                push.outstanding[rank] += 1;
                let (me, transfer, kv, session) = (
                    self.me.clone(),
                    *transfer,
                    self.kv.clone(),
                    push.session.clone(),
                );
                tokio::spawn(async move {
                    let mut ops = ops;
                    let (bytes, result) = match kv.transfer_fault(&mut ops).await {
                        Err(e) => (0, Err(e)),
                        Ok(()) => match session.submit(&ops) {
                            Ok(batch) => (
                                batch.bytes(),
                                batch.wait(kv.timeout).await.map_err(|e| e.to_string()),
                            ),
                            Err(e) => (0, Err(format!("KV write refused: {e}"))),
                        },
                    };
                    let _ = me.cast(KvSenderMsg::WriteDone {
                        transfer,
                        rank,
                        bytes,
                        result,
                    });
                });
            }
            if layer == last_layer && *end >= prompt_len {
                push.complete[rank] = true;
            }
            touched.push(*transfer);
        }
        if layer == last_layer {
            entry.last_layer_seen[rank] = true;
            if entry.last_layer_seen.iter().all(|&s| s) {
                self.steps.remove(&step_id);
            }
        }
        for t in touched {
            self.settle(t);
        }
    }

    /// Reports what can be reported; closes the hand-off once it is decided and no write of
    /// it is in flight.
    fn settle(&mut self, transfer: TransferId) {
        let Some(push) = self.pushes.get_mut(&transfer) else {
            return;
        };
        let drained = push.outstanding.iter().all(|&n| n == 0);
        let epoch = |r: usize| push.epochs.get(r).copied().unwrap_or(0);
        if let Some(reason) = push.failed.clone() {
            if !drained {
                return;
            }
            self.kv.failures.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::KV_TRANSFER_FAILURES_TOTAL, m::LABEL_KIND => m::kv_failure_kind(&reason))
                .increment(1);
            tracing::warn!(%transfer, error = %reason, "KV push failed");
            match push.done.take() {
                // Never reached a step: answer directly.
                Some(done) => {
                    let _ = done.send(Err(reason));
                }
                None => {
                    let _ = self.aggregator.cast(AggregatorMsg::Report {
                        transfer,
                        rank: 0,
                        epoch: epoch(0),
                        report: RankReport::Failed(reason),
                    });
                }
            }
            self.close(transfer);
            return;
        }
        for r in 0..push.complete.len() {
            if push.complete[r] && push.outstanding[r] == 0 && !push.reported[r] {
                push.reported[r] = true;
                let _ = self.aggregator.cast(AggregatorMsg::Report {
                    transfer,
                    rank: r,
                    epoch: epoch(r),
                    report: RankReport::Done,
                });
            }
        }
        if push.reported.iter().all(|&r| r) {
            let secs = push.opened.elapsed().as_secs_f64();
            metrics::histogram!(m::KV_TRANSFER_SECONDS, m::LABEL_MODE => "push").record(secs);
            tracing::info!(%transfer, ms = (secs * 1e3) as u64, "KV pushed");
            self.close(transfer);
        }
    }

    fn close(&mut self, transfer: TransferId) {
        if let Some(push) = self.pushes.remove(&transfer) {
            self.kv.in_flight.fetch_sub(1, Ordering::Relaxed);
            for d in push.drained {
                let _ = d.send(());
            }
        }
    }
}
