//! The Aggregator: joins the per-TP-rank reports of a KV hand-off into one outcome.
//!
//! A request's KV has been sent (prefill, push) or received (decode, pull) only when every TP
//! rank reported its share done. Reports are counted by rank index, so a duplicate report
//! changes nothing; a failure report from any rank ends the hand-off at once (an explicit
//! terminal message: nobody waits for the reports that will not come); a report from an
//! older epoch of a rank than the one the hand-off was opened with is dropped. The pure
//! bookkeeping is [`Aggregation`]; the actor keeps one per open hand-off and answers the
//! waiter registered with [`AggregatorMsg::Expect`] exactly once.
//!
//! Supervised by the `InstanceSupervisor`, which restarts it: the waiters of the hand-offs
//! it had open see their outcome channel close (a failure), and the KvSender and KvReceiver
//! reach the new incarnation through the same [`Mailbox`](crate::mailbox::Mailbox).

use pdserve_runtime::ids::TransferId;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use tokio::sync::oneshot;

/// The outcome of one hand-off over all ranks.
pub type HandoffOutcome = Result<(), String>;

/// What one rank reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankReport {
    /// Its share is done.
    Done,
    /// Its share failed.
    Failed(String),
}

/// The joining of one hand-off's rank reports.
#[derive(Debug, Clone)]
pub struct Aggregation {
    epochs: Vec<u64>,
    done: Vec<bool>,
    outcome: Option<HandoffOutcome>,
}

impl Aggregation {
    /// Waits for `epochs.len()` ranks; rank `r` reports with epoch `epochs[r]` or newer.
    pub fn new(epochs: Vec<u64>) -> Self {
        let n = epochs.len();
        Self {
            epochs,
            done: vec![false; n],
            outcome: None,
        }
    }

    /// Applies a report; returns the outcome the first time it is decided, `None` otherwise
    /// (still waiting, already decided, duplicate, unknown rank or stale epoch).
    pub fn report(
        &mut self,
        rank: usize,
        epoch: u64,
        report: RankReport,
    ) -> Option<HandoffOutcome> {
        if self.outcome.is_some() || rank >= self.done.len() || epoch < self.epochs[rank] {
            return None;
        }
        match report {
            RankReport::Failed(e) => {
                let o = Err(format!("TP rank {rank}: {e}"));
                self.outcome = Some(o.clone());
                Some(o)
            }
            RankReport::Done => {
                if std::mem::replace(&mut self.done[rank], true) {
                    return None; // duplicate
                }
                if self.done.iter().all(|&d| d) {
                    self.outcome = Some(Ok(()));
                    return Some(Ok(()));
                }
                None
            }
        }
    }

    /// Ranks that reported done.
    pub fn reported(&self) -> usize {
        self.done.iter().filter(|&&d| d).count()
    }
}

/// Messages of the Aggregator.
pub enum AggregatorMsg {
    /// Opens a hand-off over `epochs.len()` ranks; `done` gets its outcome once.
    Expect {
        /// The hand-off.
        transfer: TransferId,
        /// Current epoch per rank.
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
        /// Its epoch.
        epoch: u64,
        /// What it says.
        report: RankReport,
    },
    /// Closes a hand-off without an outcome (its owner gave up); later reports are ignored.
    Forget(TransferId),
    /// Open hand-offs.
    Open(ractor::RpcReplyPort<usize>),
}

/// The Aggregator actor (its mailbox count).
#[derive(Debug)]
pub struct Aggregator(pub crate::mailbox::Inbox);

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
                epochs,
                done,
            } => {
                if epochs.is_empty() {
                    let _ = done.send(Ok(()));
                } else {
                    open.insert(transfer, (Aggregation::new(epochs), done));
                }
            }
            AggregatorMsg::Report {
                transfer,
                rank,
                epoch,
                report,
            } => {
                let decided = open
                    .get_mut(&transfer)
                    .and_then(|(agg, _)| agg.report(rank, epoch, report));
                if let Some(outcome) = decided {
                    if let Some((_, done)) = open.remove(&transfer) {
                        let _ = done.send(outcome);
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_every_rank_and_ignores_duplicates() {
        let mut a = Aggregation::new(vec![1, 1, 1]);
        assert_eq!(a.report(0, 1, RankReport::Done), None);
        assert_eq!(a.report(0, 1, RankReport::Done), None, "duplicate");
        assert_eq!(a.report(0, 1, RankReport::Done), None, "duplicate");
        assert_eq!(a.reported(), 1, "a duplicate counts once");
        assert_eq!(a.report(2, 1, RankReport::Done), None);
        assert_eq!(a.report(7, 1, RankReport::Done), None, "no such rank");
        assert_eq!(a.report(1, 1, RankReport::Done), Some(Ok(())));
        assert_eq!(a.report(1, 1, RankReport::Done), None, "decided once");
    }

    #[test]
    fn a_failure_ends_it_at_once_and_stale_epochs_are_dropped() {
        let mut a = Aggregation::new(vec![2, 5]);
        assert_eq!(
            a.report(1, 4, RankReport::Failed("old".into())),
            None,
            "a report from before rank 1's restart"
        );
        assert_eq!(a.report(0, 2, RankReport::Done), None);
        let o = a.report(1, 5, RankReport::Failed("peer gone".into()));
        assert!(matches!(o, Some(Err(ref e)) if e.contains("rank 1") && e.contains("peer gone")));
        assert_eq!(a.report(1, 5, RankReport::Done), None);
    }

    #[tokio::test]
    async fn the_actor_answers_each_waiter_once() {
        let (agg, _join) = crate::mailbox::Mailbox::spawn(None, Aggregator, ())
            .await
            .unwrap();
        let t = TransferId::new_random();
        let (tx, rx) = oneshot::channel();
        agg.cast(AggregatorMsg::Expect {
            transfer: t,
            epochs: vec![1, 1],
            done: tx,
        })
        .unwrap();
        for (rank, n) in [(1, 3), (0, 1)] {
            for _ in 0..n {
                agg.cast(AggregatorMsg::Report {
                    transfer: t,
                    rank,
                    epoch: 1,
                    report: RankReport::Done,
                })
                .unwrap();
            }
        }
        assert_eq!(rx.await.unwrap(), Ok(()));
        let open = ractor::call_t!(agg, AggregatorMsg::Open, 1000).unwrap();
        assert_eq!(open, 0, "a decided hand-off is closed");
        assert_eq!(agg.depth(), 0, "every message was taken");
        agg.stop(None);
    }
}
