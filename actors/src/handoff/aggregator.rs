//! The Aggregator: joins the per-TP-rank reports of a KV hand-off into one outcome.
//!
//! A request's KV has been sent (prefill, push) or received (decode, pull) only when every TP
//! rank of the **current epoch** reported its share done. Each rank's epoch comes from the
//! instance's [`Epochs`]: it is bumped when that rank's worker restarts (its cache is new:
//! KV written into the old one is gone) and, for every rank, when the KvSender or KvReceiver
//! restarts (the hand-offs they drove are gone). A hand-off is opened with the epochs current
//! at that moment and a fresh **attempt** number ([`AggregatorMsg::Expect`]; a hand-off that is
//! retried under the same transfer id is a new attempt); then
//! - a report from another epoch of its rank or another attempt is **stale**: dropped and
//!   counted (it was planned against a cache, an actor or an attempt that no longer exists,
//!   and must never complete a new hand-off);
//! - a second report of a rank is a **duplicate**: dropped and counted;
//! - a failure report from any rank ends the hand-off at once (an explicit terminal message:
//!   nobody waits for reports that will not come);
//! - an epoch bump of a rank the hand-off waits on ([`AggregatorMsg::EpochBumped`]) fails it
//!   (its bytes landed in, or were read from, a cache that is gone).
//!
//! The pure bookkeeping is [`Aggregation`] (with [`Epochs`], in `pdserve-core`); the actor keeps one per open hand-off and answers
//! the waiter registered with [`AggregatorMsg::Expect`] exactly once.
//!
//! Supervised by the `InstanceSupervisor`, which restarts it in place: the waiters of the
//! hand-offs it had open see their outcome channel close (a failure), and the KvSender and
//! KvReceiver reach the new incarnation through the same [`Mailbox`](crate::mailbox::Mailbox).

use super::protocol::HandoffError;
use crate::mailbox::{Inbox, Mailbox};
pub use pdserve_core::handoff::{
    next_attempt, Aggregation, Applied, Epochs, HandoffOutcome, RankReport, Tag,
};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::supervision::ActorKind;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Reports the Aggregator dropped, by reason (for `inspect` and metrics).
#[derive(Debug, Default)]
pub struct DroppedReports {
    /// From an older epoch of their rank.
    pub stale: AtomicU64,
    /// A rank reporting twice.
    pub duplicate: AtomicU64,
}

/// Messages of the Aggregator.
pub enum AggregatorMsg {
    /// Opens a hand-off over `epochs.len()` ranks; `done` gets its outcome once.
    Expect {
        /// The hand-off.
        transfer: TransferId,
        /// Its attempt ([`next_attempt`]).
        attempt: u64,
        /// Epoch per rank the reports must carry.
        epochs: Vec<u64>,
        /// Where the outcome goes.
        done: oneshot::Sender<HandoffOutcome>,
    },
    /// One rank's report.
    Report {
        /// The hand-off.
        transfer: TransferId,
        /// Reporting rank.
        rank: usize,
        /// The attempt and the rank's epoch its work was planned in.
        tag: Tag,
        /// What it says.
        report: RankReport,
    },
    /// A rank moved to a new epoch: open hand-offs waiting on an older one fail.
    EpochBumped {
        /// Rank.
        rank: usize,
        /// Its new epoch.
        epoch: u64,
    },
    /// Closes a hand-off without an outcome (its owner gave up); later reports are ignored.
    Forget(TransferId),
    /// Open hand-offs.
    Open(ractor::RpcReplyPort<usize>),
}

/// The Aggregator's typed address, for the KvSender, the KvReceiver and the supervisor.
#[derive(Clone, Debug)]
pub struct AggregatorHandle(Mailbox<AggregatorMsg>);

impl AggregatorHandle {
    /// The handle of the Aggregator behind `mailbox`.
    pub fn new(mailbox: Mailbox<AggregatorMsg>) -> Self {
        Self(mailbox)
    }

    /// Its mailbox (for calls: [`AggregatorMsg::Open`]).
    pub fn mailbox(&self) -> &Mailbox<AggregatorMsg> {
        &self.0
    }

    /// Opens a hand-off over `epochs.len()` ranks; `done` gets its outcome once.
    ///
    /// # Errors
    /// [`HandoffError::Interrupted`] when the Aggregator is gone (its supervisor restarts
    /// it; the hand-off fails).
    pub fn expect(
        &self,
        transfer: TransferId,
        attempt: u64,
        epochs: Vec<u64>,
        done: oneshot::Sender<HandoffOutcome>,
    ) -> Result<(), HandoffError> {
        let msg = AggregatorMsg::Expect {
            transfer,
            attempt,
            epochs,
            done,
        };
        if self.0.tell(ActorKind::Aggregator, "expect", msg) {
            Ok(())
        } else {
            Err(HandoffError::Interrupted("the aggregator is gone".into()))
        }
    }

    /// One rank's report. Lost with a gone Aggregator, whose hand-offs (and so this one)
    /// failed with it: their waiters saw their outcome channel close.
    pub fn report(&self, transfer: TransferId, rank: usize, tag: Tag, report: RankReport) {
        let msg = AggregatorMsg::Report {
            transfer,
            rank,
            tag,
            report,
        };
        self.0.tell(ActorKind::Aggregator, "report", msg);
    }

    /// A rank moved to a new epoch.
    pub fn epoch_bumped(&self, rank: usize, epoch: u64) {
        let msg = AggregatorMsg::EpochBumped { rank, epoch };
        self.0.tell(ActorKind::Aggregator, "epoch_bumped", msg);
    }

    /// Closes a hand-off without an outcome.
    pub fn forget(&self, transfer: TransferId) {
        self.0.tell(
            ActorKind::Aggregator,
            "forget",
            AggregatorMsg::Forget(transfer),
        );
    }
}

/// The Aggregator actor (its mailbox count and the instance's dropped-report counters).
#[derive(Debug)]
pub struct Aggregator(pub Inbox, pub Arc<DroppedReports>);

type Waiting = HashMap<TransferId, (Aggregation, oneshot::Sender<HandoffOutcome>)>;

impl Actor for Aggregator {
    type Msg = AggregatorMsg;
    type State = Waiting;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _: (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(HashMap::new())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        open: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            AggregatorMsg::Expect {
                transfer,
                attempt,
                epochs,
                done,
            } => {
                if epochs.is_empty() {
                    let _ = done.send(Ok(()));
                } else {
                    open.insert(transfer, (Aggregation::new(attempt, epochs), done));
                }
            }
            AggregatorMsg::Report {
                transfer,
                rank,
                tag,
                report,
            } => {
                let applied = open
                    .get_mut(&transfer)
                    .map_or(Applied::Stale, |(agg, _)| agg.report(rank, tag, report));
                self.settle(open, transfer, applied);
            }
            AggregatorMsg::EpochBumped { rank, epoch } => {
                let decided: Vec<(TransferId, Applied)> = open
                    .iter_mut()
                    .map(|(t, (agg, _))| (*t, agg.epoch_bumped(rank, epoch)))
                    .filter(|(_, a)| matches!(a, Applied::Decided(_)))
                    .collect();
                for (t, applied) in decided {
                    self.settle(open, t, applied);
                }
            }
            AggregatorMsg::Forget(transfer) => {
                open.remove(&transfer);
            }
            AggregatorMsg::Open(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send(open.len());
                }
            }
        }
        Ok(())
    }
}

impl Aggregator {
    fn settle(&self, open: &mut Waiting, transfer: TransferId, applied: Applied) {
        use pdserve_runtime::telemetry as m;
        match applied {
            Applied::Decided(outcome) => {
                if let Some((_, done)) = open.remove(&transfer) {
                    let _ = done.send(outcome);
                }
            }
            Applied::Stale => {
                self.1.stale.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::KV_REPORTS_DROPPED_TOTAL, m::LABEL_REASON => "stale_epoch")
                    .increment(1);
                tracing::debug!(%transfer, "dropped a rank report from an old epoch");
            }
            Applied::Duplicate => {
                self.1.duplicate.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::KV_REPORTS_DROPPED_TOTAL, m::LABEL_REASON => "duplicate")
                    .increment(1);
            }
            Applied::Waiting | Applied::Ignored => {}
        }
    }
}

/// One hand-off's rank work joined by the Aggregator, as a pull's reads and a same-GPU copy
/// both run it: opens the hand-off over the ranks' current `epochs`, runs `rank_work(rank)`
/// for every rank to its end (each result reported with the rank's tag), then waits at most
/// `bound` for the outcome. Without one (the Aggregator failed or is stuck) the hand-off
/// failed too, and the Aggregator is told to forget it.
pub(crate) async fn joined<F, Fut>(
    aggregator: &AggregatorHandle,
    transfer: TransferId,
    epochs: Vec<u64>,
    bound: std::time::Duration,
    mut rank_work: F,
) -> HandoffOutcome
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = RankReport>,
{
    let attempt = next_attempt();
    let (tx, rx) = oneshot::channel();
    aggregator.expect(transfer, attempt, epochs.clone(), tx)?;
    let work = epochs.iter().enumerate().map(|(rank, &epoch)| {
        let report = rank_work(rank);
        async move {
            let report = report.await;
            aggregator.report(transfer, rank, Tag { attempt, epoch }, report);
        }
    });
    futures_util::future::join_all(work).await;
    let outcome = match tokio::time::timeout(bound, rx).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => Err(HandoffError::Interrupted(
            "the aggregator failed during the hand-off".into(),
        )),
        Err(_) => Err(HandoffError::timeout("the aggregator's answer", bound)),
    };
    if outcome.is_err() {
        aggregator.forget(transfer);
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::protocol::HandoffError;

    async fn spawn() -> (crate::mailbox::Mailbox<AggregatorMsg>, Arc<DroppedReports>) {
        let dropped = Arc::new(DroppedReports::default());
        let d = dropped.clone();
        let (agg, _join) =
            crate::mailbox::Mailbox::spawn(None, move |inbox| Aggregator(inbox, d), ())
                .await
                .unwrap();
        (agg, dropped)
    }

    fn expect(
        agg: &crate::mailbox::Mailbox<AggregatorMsg>,
        transfer: TransferId,
        attempt: u64,
        epochs: Vec<u64>,
    ) -> oneshot::Receiver<HandoffOutcome> {
        let (tx, rx) = oneshot::channel();
        agg.cast(AggregatorMsg::Expect {
            transfer,
            attempt,
            epochs,
            done: tx,
        })
        .unwrap();
        rx
    }

    fn report(
        agg: &crate::mailbox::Mailbox<AggregatorMsg>,
        transfer: TransferId,
        rank: usize,
        attempt: u64,
        epoch: u64,
    ) {
        agg.cast(AggregatorMsg::Report {
            transfer,
            rank,
            tag: Tag { attempt, epoch },
            report: RankReport::Done,
        })
        .unwrap();
    }

    #[tokio::test]
    async fn the_actor_answers_each_waiter_once() {
        let (agg, dropped) = spawn().await;
        let t = TransferId::new_random();
        let rx = expect(&agg, t, 1, vec![1, 1]);
        for (rank, n) in [(1, 3), (0, 1)] {
            for _ in 0..n {
                report(&agg, t, rank, 1, 1);
            }
        }
        assert_eq!(rx.await.unwrap(), Ok(()));
        let open = ractor::call_t!(agg, AggregatorMsg::Open, 1000).unwrap();
        assert_eq!(open, 0, "a decided hand-off is closed");
        assert_eq!(dropped.duplicate.load(Ordering::Relaxed), 2);
        assert_eq!(agg.depth(), 0, "every message was taken");
        agg.stop(None);
    }

    /// The restart scenario: a hand-off is opened, a rank restarts (its epoch is bumped), the
    /// same transfer is opened again in the new epoch, and the old incarnation's late reports
    /// arrive. They must not complete the new hand-off; only the new attempt's reports do.
    #[tokio::test]
    async fn a_stale_report_from_before_a_restart_cannot_complete_a_new_hand_off() {
        let (agg, dropped) = spawn().await;
        let epochs = Epochs::new(2);
        let t = TransferId::new_random();
        let (old, before) = (next_attempt(), epochs.current());
        let rx_old = expect(&agg, t, old, before.clone());
        report(&agg, t, 0, old, before[0]);
        // Rank 1's worker restarts: the open hand-off fails at once.
        epochs.bump_worker(1);
        agg.cast(AggregatorMsg::EpochBumped {
            rank: 1,
            epoch: epochs.current()[1],
        })
        .unwrap();
        assert!(matches!(
            rx_old.await.unwrap(),
            Err(HandoffError::CacheLost(_))
        ));
        // The retried hand-off, a new attempt in the new epochs.
        let (new, after) = (next_attempt(), epochs.current());
        let mut rx_new = expect(&agg, t, new, after.clone());
        // Late reports of both ranks from the old attempt (rank 0's epoch did not change).
        for (rank, &epoch) in before.iter().enumerate() {
            report(&agg, t, rank, old, epoch);
        }
        // And one from the new attempt planned against rank 1's old epoch.
        report(&agg, t, 1, new, before[1]);
        let open = ractor::call_t!(agg, AggregatorMsg::Open, 1000).unwrap();
        assert_eq!(open, 1, "stale reports completed nothing");
        assert!(rx_new.try_recv().is_err(), "no outcome yet");
        assert_eq!(dropped.stale.load(Ordering::Relaxed), 3);
        report(&agg, t, 0, new, after[0]);
        report(&agg, t, 1, new, after[1]);
        assert_eq!(rx_new.await.unwrap(), Ok(()));
        // A KV actor restart moves every rank on.
        epochs.bump_incarnation();
        assert!(epochs.current().iter().zip(&after).all(|(n, o)| n > o));
        agg.stop(None);
    }
}
