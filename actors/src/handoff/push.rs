//! [`PushTracker`]: the prefill side of layerwise push hand-offs as a state machine — events
//! in, actions out, time passed in; no tokio, no I/O. The KvSender actor drives it: it
//! performs the writes the tracker plans and feeds their completions back.
//!
//! A push hand-off opens when a decode instance asks for one ([`PushEvent::Open`]). Before
//! each forward step the Scheduler says which chunks of which pushed prompts the step computes
//! ([`PushEvent::Step`]); as every TP rank has each layer's K/V in its cache it reports
//! [`PushEvent::LayerDone`], and the tracker plans the writes of that rank's heads for the
//! blocks that hold only final KV (those the chunk completes, see [`final_blocks`]) to the
//! decode ranks that own them (heterogeneous TP). A rank's share is done when the prompt's
//! last chunk passed its last layer and its writes completed: it is reported to the
//! Aggregator, tagged with the attempt and the rank's epoch of the step.
//!
//! A failed write, a failed step or a cancel fails the hand-off, but it is closed
//! ([`PushAction::Closed`]) only once no write of it is in flight: the decode side frees its
//! destination blocks when it gets the answer, so no byte may land after. The source blocks
//! (shares of the request's allocation) are kept until then too, so an abort or a preemption
//! never lets them be reused under a write.

use super::aggregator::{RankReport, Tag};
use super::plan::{final_blocks, plan_slice, Direction, Slice};
use super::protocol::{HandoffError, KvPeerInfo, SessionOffer};
use super::session::Security;
use crate::block_manager::BlockAllocation;
use pdserve_runtime::ids::TransferId;
use pdserve_transport::TransferOp;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a pushed request's KV goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The hand-off id both sides use.
    pub transfer: TransferId,
    /// The decode instance's published KV memory (validated).
    pub peer: KvPeerInfo,
    /// Its destination blocks for the prompt's blocks `skip_blocks..` (checked against the
    /// prompt length).
    pub blocks: Vec<u32>,
    /// Leading blocks of the prompt the decode instance already holds (its prefix cache):
    /// never written.
    pub skip_blocks: usize,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// The key the decode instance granted for the writes (`None`: unkeyed, `local`).
    pub session: Option<SessionOffer>,
}

impl PushTarget {
    /// Whether the writes go under the hand-off's fence at the target: it granted a session
    /// on a backend with fenced scopes.
    pub fn fenced(&self, ours: Security) -> bool {
        self.session.is_some() && ours.fenced()
    }
}

/// One chunk of a pushed request inside a forward step.
#[derive(Debug)]
pub struct PushChunk {
    /// The hand-off.
    pub transfer: TransferId,
    /// A share of the request's blocks (kept until the hand-off closes).
    pub blocks: BlockAllocation,
    /// First prompt position the step computes.
    pub start: usize,
    /// One past the last.
    pub end: usize,
}

/// What happened.
#[derive(Debug)]
pub enum PushEvent {
    /// A hand-off opens: write `target` from our KV memory `ours`, as hand-off `attempt`.
    Open {
        /// Where the KV goes.
        target: Arc<PushTarget>,
        /// Our published KV memory.
        ours: KvPeerInfo,
        /// The attempt number its rank reports carry.
        attempt: u64,
    },
    /// A step computing these chunks is about to run on ranks of these epochs.
    Step {
        /// Step id.
        step_id: u64,
        /// Epoch per rank.
        epochs: Vec<u64>,
        /// The pushed chunks.
        chunks: Vec<PushChunk>,
    },
    /// A rank has `layer` of step `step_id` in its cache.
    LayerDone {
        /// Step.
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
    /// A write batch ended: its bytes, or why it failed.
    WriteDone {
        /// The hand-off.
        transfer: TransferId,
        /// The writing rank.
        rank: usize,
        /// Bytes written, or the failure.
        result: Result<u64, HandoffError>,
    },
    /// Give up on a hand-off (the request failed, or decode aborted it).
    Cancel {
        /// The hand-off.
        transfer: TransferId,
        /// Why.
        reason: HandoffError,
    },
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAction {
    /// Open the hand-off with the Aggregator (the first step reached it).
    Expect {
        /// The hand-off.
        transfer: TransferId,
        /// Its attempt.
        attempt: u64,
        /// Epoch per rank of that step.
        epochs: Vec<u64>,
    },
    /// Submit these writes; answer with [`PushEvent::WriteDone`].
    Write {
        /// The hand-off.
        transfer: TransferId,
        /// The rank whose heads they carry.
        rank: usize,
        /// The operations.
        ops: Vec<TransferOp>,
    },
    /// Report a rank's share to the Aggregator.
    Report {
        /// The hand-off.
        transfer: TransferId,
        /// Rank.
        rank: usize,
        /// Attempt and epoch.
        tag: Tag,
        /// Done or failed.
        report: RankReport,
    },
    /// The hand-off failed before any step reached it (the Aggregator never heard of it):
    /// answer its opener directly.
    FailUnopened {
        /// The hand-off.
        transfer: TransferId,
        /// Why.
        error: HandoffError,
    },
    /// The hand-off is closed: no write of it is in flight any more, its source blocks went
    /// back. Exactly once per opened hand-off.
    Closed {
        /// The hand-off.
        transfer: TransferId,
        /// How it ended.
        result: Result<(), HandoffError>,
        /// Bytes written.
        bytes: u64,
        /// Since it opened.
        elapsed: Duration,
    },
    /// A cancel named a hand-off this tracker does not have (closed already, or opened by
    /// a failed incarnation of the KvSender).
    Unknown {
        /// The hand-off.
        transfer: TransferId,
    },
}

#[derive(Debug)]
struct Push {
    target: Arc<PushTarget>,
    ours: KvPeerInfo,
    attempt: u64,
    /// Epochs of the first step that reached it; `None` before (the Aggregator does not know it).
    epochs: Option<Vec<u64>>,
    sources: Vec<BlockAllocation>,
    outstanding: Vec<usize>,
    complete: Vec<bool>,
    reported: Vec<bool>,
    failed: Option<HandoffError>,
    bytes: u64,
    opened: Instant,
}

#[derive(Debug)]
struct StepEntry {
    epochs: Vec<u64>,
    chunks: Vec<(TransferId, Vec<u32>, usize, usize)>,
    /// Per rank, which layers reported.
    seen: Vec<Vec<bool>>,
}

/// The shape the tracker plans for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushShape {
    /// Decoder layers.
    pub num_layers: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Our TP ranks.
    pub tp: usize,
}

/// The prefill side of every open push hand-off of one instance.
#[derive(Debug)]
pub struct PushTracker {
    shape: PushShape,
    pushes: HashMap<TransferId, Push>,
    steps: HashMap<u64, StepEntry>,
}

impl PushTracker {
    /// An empty tracker.
    pub fn new(shape: PushShape) -> Self {
        Self {
            shape,
            pushes: HashMap::new(),
            steps: HashMap::new(),
        }
    }

    /// Open hand-offs.
    pub fn open(&self) -> usize {
        self.pushes.len()
    }

    /// Steps still waiting for layer reports.
    pub fn steps_tracked(&self) -> usize {
        self.steps.len()
    }

    /// Applies an event at `now`.
    pub fn on(&mut self, event: PushEvent, now: Instant) -> Vec<PushAction> {
        let mut a = Vec::new();
        match event {
            PushEvent::Open {
                target,
                ours,
                attempt,
            } => {
                let tp = self.shape.tp;
                let transfer = target.transfer;
                self.pushes.insert(
                    transfer,
                    Push {
                        target,
                        ours,
                        attempt,
                        epochs: None,
                        sources: Vec::new(),
                        outstanding: vec![0; tp],
                        complete: vec![false; tp],
                        reported: vec![false; tp],
                        failed: None,
                        bytes: 0,
                        opened: now,
                    },
                );
            }
            PushEvent::Step {
                step_id,
                epochs,
                chunks,
            } => {
                let mut entry = StepEntry {
                    seen: vec![vec![false; self.shape.num_layers]; epochs.len()],
                    epochs: epochs.clone(),
                    chunks: Vec::new(),
                };
                for c in chunks {
                    let Some(push) = self.pushes.get_mut(&c.transfer) else {
                        continue; // closed meanwhile: the share drops here
                    };
                    if push.failed.is_some() {
                        continue;
                    }
                    if push.epochs.is_none() {
                        push.epochs = Some(epochs.clone());
                        a.push(PushAction::Expect {
                            transfer: c.transfer,
                            attempt: push.attempt,
                            epochs: epochs.clone(),
                        });
                    }
                    entry
                        .chunks
                        .push((c.transfer, c.blocks.blocks().to_vec(), c.start, c.end));
                    push.sources.push(c.blocks);
                }
                if !entry.chunks.is_empty() {
                    self.steps.insert(step_id, entry);
                }
            }
            PushEvent::LayerDone {
                step_id,
                rank,
                epoch,
                layer,
            } => self.on_layer(step_id, rank, epoch, layer, now, &mut a),
            PushEvent::StepFailed(step_id) => {
                if let Some(entry) = self.steps.remove(&step_id) {
                    for (t, ..) in entry.chunks {
                        if let Some(push) = self.pushes.get_mut(&t) {
                            push.failed.get_or_insert(HandoffError::Interrupted(
                                "the forward step computing the prompt failed".into(),
                            ));
                        }
                        self.settle(t, now, &mut a);
                    }
                }
            }
            PushEvent::WriteDone {
                transfer,
                rank,
                result,
            } => {
                if let Some(push) = self.pushes.get_mut(&transfer) {
                    push.outstanding[rank] = push.outstanding[rank].saturating_sub(1);
                    match result {
                        Ok(bytes) => push.bytes += bytes,
                        Err(e) => {
                            push.failed.get_or_insert(e);
                        }
                    }
                    self.settle(transfer, now, &mut a);
                }
            }
            PushEvent::Cancel { transfer, reason } => match self.pushes.get_mut(&transfer) {
                Some(push) => {
                    push.failed.get_or_insert(reason);
                    self.settle(transfer, now, &mut a);
                }
                None => a.push(PushAction::Unknown { transfer }),
            },
        }
        a
    }

    fn on_layer(
        &mut self,
        step_id: u64,
        rank: usize,
        epoch: u64,
        layer: usize,
        now: Instant,
        a: &mut Vec<PushAction>,
    ) {
        let bs = self.shape.block_size;
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
        match entry.seen.get_mut(rank).and_then(|s| s.get_mut(layer)) {
            Some(seen) if !*seen => *seen = true,
            _ => return, // a duplicate, or no such layer
        }
        // The rank's share of this step is computed once every layer reported (in practice
        // they arrive in order: the last one is the last).
        let rank_done = entry.seen[rank].iter().all(|&s| s);
        let mut touched = Vec::new();
        for (transfer, local, start, end) in &entry.chunks {
            let Some(push) = self.pushes.get_mut(transfer) else {
                continue;
            };
            if push.failed.is_some() {
                continue;
            }
            let prompt_len = push.target.prompt_len;
            // Blocks the decode side holds already are skipped: block `i` of the prompt goes
            // to destination `i - skip`.
            let skip = push.target.skip_blocks;
            let blocks = final_blocks(*start, *end, prompt_len, bs);
            let blocks = blocks.start.max(skip) - skip..blocks.end.max(skip) - skip;
            let slice = Slice {
                rank,
                layers: layer..layer + 1,
                blocks,
            };
            if !slice.blocks.is_empty() && local.len() >= skip {
                let ops = plan_slice(
                    &push.ours,
                    &push.target.peer,
                    &local[skip..],
                    &push.target.blocks,
                    &slice,
                    Direction::Write,
                );
                push.outstanding[rank] += 1;
                a.push(PushAction::Write {
                    transfer: *transfer,
                    rank,
                    ops,
                });
            }
            if rank_done && *end >= prompt_len {
                push.complete[rank] = true;
            }
            touched.push(*transfer);
        }
        if entry.seen.iter().all(|r| r.iter().all(|&s| s)) {
            self.steps.remove(&step_id);
        }
        for t in touched {
            self.settle(t, now, a);
        }
    }

    /// Reports what can be reported; closes the hand-off once it is decided and no write of
    /// it is in flight.
    fn settle(&mut self, transfer: TransferId, now: Instant, a: &mut Vec<PushAction>) {
        let Some(push) = self.pushes.get_mut(&transfer) else {
            return;
        };
        let drained = push.outstanding.iter().all(|&n| n == 0);
        let tag = |p: &Push, r: usize| Tag {
            attempt: p.attempt,
            epoch: p
                .epochs
                .as_ref()
                .and_then(|e| e.get(r).copied())
                .unwrap_or(0),
        };
        if let Some(error) = push.failed.clone() {
            if !drained {
                return;
            }
            a.push(match push.epochs {
                None => PushAction::FailUnopened {
                    transfer,
                    error: error.clone(),
                },
                Some(_) => PushAction::Report {
                    transfer,
                    rank: 0,
                    tag: tag(push, 0),
                    report: RankReport::Failed(error.clone()),
                },
            });
            self.close(transfer, Err(error), now, a);
            return;
        }
        for r in 0..push.complete.len() {
            if push.complete[r] && push.outstanding[r] == 0 && !push.reported[r] {
                push.reported[r] = true;
                a.push(PushAction::Report {
                    transfer,
                    rank: r,
                    tag: tag(push, r),
                    report: RankReport::Done,
                });
            }
        }
        if push.reported.iter().all(|&r| r) {
            self.close(transfer, Ok(()), now, a);
        }
    }

    fn close(
        &mut self,
        transfer: TransferId,
        result: Result<(), HandoffError>,
        now: Instant,
        a: &mut Vec<PushAction>,
    ) {
        if let Some(push) = self.pushes.remove(&transfer) {
            a.push(PushAction::Closed {
                transfer,
                result,
                bytes: push.bytes,
                elapsed: now.saturating_duration_since(push.opened),
            });
            // `push.sources` drop here: the source blocks go back.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_manager::BlockManager;
    use crate::handoff::protocol::{compat_hash, RankKv};
    use pdserve_gpu::kv::{KvDtype, KvLayout};
    use proptest::prelude::*;

    const LAYERS: usize = 2;
    const BS: usize = 4;

    fn info(tp: usize, name: &str) -> KvPeerInfo {
        KvPeerInfo {
            engine_id: name.into(),
            compat_key: "k".into(),
            compat_hash: compat_hash("k"),
            transfer_addr: "a".into(),
            backend: "local".into(),
            num_kv_heads: 2,
            ranks: (0..tp)
                .map(|r| RankKv {
                    heads: (r * 2 / tp, (r + 1) * 2 / tp),
                    layout: KvLayout {
                        num_layers: LAYERS,
                        num_blocks: 128,
                        block_size: BS,
                        num_kv_heads: 2 / tp,
                        head_dim: 4,
                        dtype: KvDtype::F32,
                    },
                    regions: (0..LAYERS as u64).map(|l| 100 * r as u64 + l).collect(),
                })
                .collect(),
        }
    }

    fn tracker(tp: usize) -> PushTracker {
        PushTracker::new(PushShape {
            num_layers: LAYERS,
            block_size: BS,
            tp,
        })
    }

    fn open(t: &mut PushTracker, transfer: TransferId, prompt_len: usize, tp: usize) {
        let n = prompt_len.div_ceil(BS);
        let a = t.on(
            PushEvent::Open {
                target: Arc::new(PushTarget {
                    transfer,
                    peer: info(1, "decode"),
                    blocks: (0..n as u32).collect(),
                    skip_blocks: 0,
                    prompt_len,
                    session: None,
                }),
                ours: info(tp, "prefill"),
                attempt: 5,
            },
            Instant::now(),
        );
        assert!(a.is_empty());
    }

    fn chunk(pool: &BlockManager, transfer: TransferId, start: usize, end: usize) -> PushChunk {
        let mut blocks = pool.empty();
        assert!(pool.grow(&mut blocks, end.div_ceil(BS)));
        PushChunk {
            transfer,
            blocks,
            start,
            end,
        }
    }

    #[test]
    fn one_step_two_ranks_writes_every_layer_then_reports_and_closes() {
        let now = Instant::now();
        let pool = BlockManager::new(16, 0);
        let mut t = tracker(2);
        let x = TransferId(1);
        open(&mut t, x, 6, 2);
        let a = t.on(
            PushEvent::Step {
                step_id: 1,
                epochs: vec![10, 20],
                chunks: vec![chunk(&pool, x, 0, 6)],
            },
            now,
        );
        assert_eq!(
            a,
            vec![PushAction::Expect {
                transfer: x,
                attempt: 5,
                epochs: vec![10, 20]
            }]
        );
        let mut writes = 0;
        for layer in 0..LAYERS {
            for (rank, epoch) in [(0, 10), (1, 20)] {
                for act in t.on(
                    PushEvent::LayerDone {
                        step_id: 1,
                        rank,
                        epoch,
                        layer,
                    },
                    now,
                ) {
                    assert!(matches!(act, PushAction::Write { .. }), "{act:?}");
                    writes += 1;
                }
            }
        }
        assert_eq!(writes, 4, "one batch per rank and layer");
        assert_eq!(
            pool.num_free(),
            14,
            "sources held while writes are in flight"
        );
        let mut closed = Vec::new();
        for rank in [0, 0, 1, 1] {
            closed.extend(t.on(
                PushEvent::WriteDone {
                    transfer: x,
                    rank,
                    result: Ok(100),
                },
                now,
            ));
        }
        assert!(
            matches!(
                &closed[..],
                [
                    PushAction::Report {
                        rank: 0,
                        report: RankReport::Done,
                        tag: Tag {
                            attempt: 5,
                            epoch: 10
                        },
                        ..
                    },
                    PushAction::Report {
                        rank: 1,
                        report: RankReport::Done,
                        tag: Tag {
                            attempt: 5,
                            epoch: 20
                        },
                        ..
                    },
                    PushAction::Closed {
                        result: Ok(()),
                        bytes: 400,
                        ..
                    }
                ]
            ),
            "{closed:?}"
        );
        assert_eq!(pool.num_free(), 16, "sources back");
        assert_eq!(t.open(), 0);
        assert_eq!(t.steps_tracked(), 0);
    }

    #[test]
    fn a_cancel_closes_only_after_the_writes_in_flight_ended() {
        let now = Instant::now();
        let pool = BlockManager::new(16, 0);
        let mut t = tracker(1);
        let x = TransferId(2);
        open(&mut t, x, 8, 1);
        t.on(
            PushEvent::Step {
                step_id: 1,
                epochs: vec![1],
                chunks: vec![chunk(&pool, x, 0, 8)],
            },
            now,
        );
        let w = t.on(
            PushEvent::LayerDone {
                step_id: 1,
                rank: 0,
                epoch: 1,
                layer: 0,
            },
            now,
        );
        assert_eq!(w.len(), 1);
        let a = t.on(
            PushEvent::Cancel {
                transfer: x,
                reason: HandoffError::Aborted,
            },
            now,
        );
        assert!(a.is_empty(), "a write is in flight: {a:?}");
        let a = t.on(
            PushEvent::LayerDone {
                step_id: 1,
                rank: 0,
                epoch: 1,
                layer: 1,
            },
            now,
        );
        assert!(a.is_empty(), "nothing new is written after a cancel: {a:?}");
        let a = t.on(
            PushEvent::WriteDone {
                transfer: x,
                rank: 0,
                result: Ok(1),
            },
            now,
        );
        assert!(
            matches!(
                &a[..],
                [
                    PushAction::Report {
                        report: RankReport::Failed(HandoffError::Aborted),
                        ..
                    },
                    PushAction::Closed {
                        result: Err(HandoffError::Aborted),
                        ..
                    }
                ]
            ),
            "{a:?}"
        );
        assert_eq!(pool.num_free(), 16);
    }

    #[test]
    fn a_hand_off_failing_before_its_first_step_is_answered_directly() {
        let mut t = tracker(1);
        let x = TransferId(3);
        open(&mut t, x, 4, 1);
        let a = t.on(
            PushEvent::Cancel {
                transfer: x,
                reason: HandoffError::Aborted,
            },
            Instant::now(),
        );
        assert!(matches!(
            &a[..],
            [PushAction::FailUnopened { .. }, PushAction::Closed { .. }]
        ));
        let a = t.on(
            PushEvent::Cancel {
                transfer: x,
                reason: HandoffError::Aborted,
            },
            Instant::now(),
        );
        assert_eq!(a, vec![PushAction::Unknown { transfer: x }]);
    }

    #[derive(Debug, Clone)]
    enum Ev {
        /// A step with chunk `k` of every open transfer.
        Step,
        Layer(usize, usize),
        Stale(usize),
        WriteDone(usize, bool),
        StepFailed,
        Cancel(usize),
    }

    fn evs() -> impl Strategy<Value = Vec<Ev>> {
        proptest::collection::vec(
            prop_oneof![
                2 => Just(Ev::Step),
                6 => (0usize..2, 0usize..LAYERS).prop_map(|(r, l)| Ev::Layer(r, l)),
                1 => (0usize..2).prop_map(Ev::Stale),
                5 => (0usize..8, any::<bool>()).prop_map(|(i, ok)| Ev::WriteDone(i, ok)),
                1 => Just(Ev::StepFailed),
                1 => (0usize..3).prop_map(Ev::Cancel),
            ],
            0..40,
        )
    }

    #[derive(Default)]
    struct Seen {
        terminal: HashMap<TransferId, usize>,
        done_reports: HashMap<TransferId, usize>,
        closed: HashMap<TransferId, usize>,
    }

    impl Seen {
        fn check(
            &mut self,
            acts: Vec<PushAction>,
            in_flight: &mut Vec<(TransferId, usize)>,
            failed: &std::collections::HashSet<TransferId>,
            tp: usize,
        ) -> Result<(), TestCaseError> {
            for act in acts {
                match act {
                    PushAction::Write { transfer, rank, .. } => {
                        prop_assert!(!failed.contains(&transfer), "write planned after failure");
                        in_flight.push((transfer, rank));
                    }
                    PushAction::Report {
                        transfer,
                        report: RankReport::Done,
                        ..
                    } => {
                        *self.done_reports.entry(transfer).or_default() += 1;
                        prop_assert!(!self.terminal.contains_key(&transfer), "done after failure");
                    }
                    PushAction::Report {
                        transfer,
                        report: RankReport::Failed(_),
                        ..
                    }
                    | PushAction::FailUnopened { transfer, .. } => {
                        *self.terminal.entry(transfer).or_default() += 1;
                        prop_assert!(
                            self.done_reports.get(&transfer).copied().unwrap_or(0) < tp,
                            "failure after all done"
                        );
                    }
                    PushAction::Closed { transfer, .. } => {
                        *self.closed.entry(transfer).or_default() += 1;
                        prop_assert!(
                            !in_flight.iter().any(|(x, _)| *x == transfer),
                            "closed with writes in flight"
                        );
                    }
                    PushAction::Expect { .. } | PushAction::Unknown { .. } => {}
                }
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Whatever the order of steps, layer reports, write completions, failures and
        /// cancels: each hand-off sends at most one terminal message (a failure report, or
        /// every rank's done report, never both), closes once, never plans a write after it
        /// failed, and once every write ended and every step is settled all blocks are back.
        #[test]
        fn no_sequence_sends_two_terminals_or_leaks_blocks(evs in evs()) {
            let now = Instant::now();
            let tp = 2;
            let pool = BlockManager::new(64, 0);
            let mut t = tracker(tp);
            let transfers: Vec<TransferId> = (0..3).map(|i| TransferId(100 + i)).collect();
            for &x in &transfers {
                open(&mut t, x, 10, tp);
            }
            let mut pos = 0usize; // prompt position the next step starts at
            let mut step_id = 0u64;
            let mut in_flight: Vec<(TransferId, usize)> = Vec::new();
            let mut seen = Seen::default();
            let mut failed: std::collections::HashSet<TransferId> = Default::default();
            for ev in evs {
                let acts = match ev {
                    Ev::Step if pos < 10 => {
                        step_id += 1;
                        let end = (pos + 4).min(10);
                        let chunks = transfers.iter().map(|&x| chunk(&pool, x, pos, end)).collect();
                        pos = end;
                        t.on(PushEvent::Step { step_id, epochs: vec![1; tp], chunks }, now)
                    }
                    Ev::Step => Vec::new(),
                    Ev::Layer(rank, layer) => t.on(PushEvent::LayerDone { step_id, rank, epoch: 1, layer }, now),
                    Ev::Stale(rank) => {
                        let a = t.on(PushEvent::LayerDone { step_id, rank, epoch: 0, layer: LAYERS - 1 }, now);
                        prop_assert!(a.is_empty(), "a stale layer report planned something");
                        a
                    }
                    Ev::WriteDone(i, ok) if !in_flight.is_empty() => {
                        let (transfer, rank) = in_flight.remove(i % in_flight.len());
                        let result = if ok { Ok(8) } else { Err(HandoffError::Injected("write".into())) };
                        if !ok { failed.insert(transfer); }
                        t.on(PushEvent::WriteDone { transfer, rank, result }, now)
                    }
                    Ev::WriteDone(..) => Vec::new(),
                    Ev::StepFailed => {
                        let before = t.steps_tracked();
                        let a = t.on(PushEvent::StepFailed(step_id), now);
                        if t.steps_tracked() < before {
                            // The step was live: every hand-off in it failed.
                            for x in &transfers { failed.insert(*x); }
                        }
                        a
                    }
                    Ev::Cancel(i) => {
                        failed.insert(transfers[i]);
                        t.on(PushEvent::Cancel { transfer: transfers[i], reason: HandoffError::Aborted }, now)
                    }
                };
                seen.check(acts, &mut in_flight, &failed, tp)?;
            }
            // Settle: every write ends, the current step fails (its layers will not come),
            // every hand-off is cancelled.
            while let Some((transfer, rank)) = in_flight.pop() {
                let a = t.on(PushEvent::WriteDone { transfer, rank, result: Ok(1) }, now);
                seen.check(a, &mut in_flight, &failed, tp)?;
            }
            let a = t.on(PushEvent::StepFailed(step_id), now);
            seen.check(a, &mut in_flight, &failed, tp)?;
            for &x in &transfers {
                let a = t.on(PushEvent::Cancel { transfer: x, reason: HandoffError::Aborted }, now);
                seen.check(a, &mut in_flight, &failed, tp)?;
            }
            for x in &transfers {
                prop_assert_eq!(seen.closed.get(x).copied().unwrap_or(0), 1, "closed exactly once");
                let t_count = seen.terminal.get(x).copied().unwrap_or(0);
                let d = seen.done_reports.get(x).copied().unwrap_or(0);
                prop_assert!(t_count <= 1 && d <= tp);
                prop_assert!((t_count == 1) != (d == tp), "exactly one way to end: {t_count} failure(s), {d} done");
            }
            prop_assert_eq!(t.open(), 0);
            // Steps whose every rank saw the last layer are gone; the rest hold only ids.
            prop_assert_eq!(pool.num_free(), 64, "every source block is back");
        }
    }
}
