//! The pure bookkeeping of the Aggregator (`pdserve_actors::handoff::aggregator`): the epochs
//! of an instance's TP ranks ([`Epochs`]) and the joining of one hand-off's per-rank reports
//! ([`Aggregation`]). A hand-off is decided once every rank of the epochs it was opened with
//! reported done, or at the first failure, or when a rank it waits on moves to a new epoch;
//! reports of another attempt or epoch are stale, a second report of a rank a duplicate.

use super::HandoffError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The outcome of one hand-off over all ranks.
pub type HandoffOutcome = Result<(), HandoffError>;

/// The epochs of one instance's TP ranks, shared by everyone who plans or reports KV work.
///
/// A rank's hand-off epoch combines two counters: the instance-wide **incarnation** of its KV
/// actors (bumped when the KvSender or KvReceiver restarts: the hand-offs they drove are gone)
/// in the high 32 bits, and the rank's **worker epoch** (bumped when its TpWorker restarts:
/// its cache is new) in the low 32. The worker epoch alone tags forward steps (the
/// Scheduler's `StepDone` check); the combined value tags hand-off reports. The incarnation
/// starts at a random value, so an epoch never matches one of another start of the instance.
#[derive(Debug)]
pub struct Epochs {
    incarnation: AtomicU64,
    workers: Vec<AtomicU64>,
}

impl Epochs {
    /// `tp` ranks, every worker at epoch 1.
    pub fn new(tp: usize) -> Arc<Self> {
        let start = (pdserve_runtime::ids::TransferId::new_random().0 as u64) & 0x00ff_ffff;
        Arc::new(Self {
            incarnation: AtomicU64::new(start),
            workers: (0..tp).map(|_| AtomicU64::new(1)).collect(),
        })
    }

    /// The worker epoch of `rank`.
    pub fn worker(&self, rank: usize) -> u64 {
        self.workers[rank].load(Ordering::SeqCst)
    }

    /// `rank`'s worker restarts: returns its new worker epoch.
    pub fn bump_worker(&self, rank: usize) -> u64 {
        self.workers[rank].fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The KvSender or KvReceiver restarts: every rank's hand-off epoch moves on.
    pub fn bump_incarnation(&self) {
        self.incarnation.fetch_add(1, Ordering::SeqCst);
    }

    /// The hand-off epoch of work a rank does in worker epoch `worker_epoch`.
    pub fn tag(&self, worker_epoch: u64) -> u64 {
        (self.incarnation.load(Ordering::SeqCst) << 32) | (worker_epoch & 0xffff_ffff)
    }

    /// The current hand-off epoch of every rank.
    pub fn current(&self) -> Vec<u64> {
        (0..self.workers.len())
            .map(|r| self.tag(self.worker(r)))
            .collect()
    }

    /// Ranks.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there are no ranks.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Where a rank's report comes from: the hand-off attempt and the rank's epoch its work was
/// planned in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// The hand-off attempt ([`next_attempt`]).
    pub attempt: u64,
    /// The rank's epoch.
    pub epoch: u64,
}

/// A fresh hand-off attempt number (process-wide).
pub fn next_attempt() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What one rank reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankReport {
    /// Its share is done.
    Done,
    /// Its share failed.
    Failed(HandoffError),
}

/// What applying a report did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Counted; still waiting for other ranks.
    Waiting,
    /// The hand-off is decided now (first and only time).
    Decided(HandoffOutcome),
    /// Dropped: the rank already reported.
    Duplicate,
    /// Dropped: the report comes from an older epoch of its rank.
    Stale,
    /// Dropped: no such rank, or the hand-off was already decided.
    Ignored,
}

/// The joining of one hand-off's rank reports.
#[derive(Debug, Clone)]
pub struct Aggregation {
    attempt: u64,
    epochs: Vec<u64>,
    done: Vec<bool>,
    outcome: Option<HandoffOutcome>,
}

impl Aggregation {
    /// Waits for `epochs.len()` ranks; rank `r` must report for `attempt` with exactly epoch
    /// `epochs[r]`.
    pub fn new(attempt: u64, epochs: Vec<u64>) -> Self {
        let n = epochs.len();
        Self {
            attempt,
            epochs,
            done: vec![false; n],
            outcome: None,
        }
    }

    /// Applies a report.
    pub fn report(&mut self, rank: usize, tag: Tag, report: RankReport) -> Applied {
        if self.outcome.is_some() || rank >= self.done.len() {
            return Applied::Ignored;
        }
        if tag.attempt != self.attempt || tag.epoch != self.epochs[rank] {
            return Applied::Stale;
        }
        match report {
            RankReport::Failed(e) => self.decide(Err(e)),
            RankReport::Done => {
                if std::mem::replace(&mut self.done[rank], true) {
                    return Applied::Duplicate;
                }
                if self.done.iter().all(|&d| d) {
                    self.decide(Ok(()))
                } else {
                    Applied::Waiting
                }
            }
        }
    }

    /// Rank `rank` moved to `epoch`: if this hand-off waits on an older epoch of it, it fails.
    pub fn epoch_bumped(&mut self, rank: usize, epoch: u64) -> Applied {
        match self.epochs.get(rank) {
            Some(&e) if self.outcome.is_none() && e < epoch => {
                self.decide(Err(HandoffError::CacheLost(format!(
                    "TP rank {rank} moved to a new epoch while this hand-off waited on it"
                ))))
            }
            _ => Applied::Ignored,
        }
    }

    fn decide(&mut self, o: HandoffOutcome) -> Applied {
        self.outcome = Some(o.clone());
        Applied::Decided(o)
    }

    /// Ranks that reported done.
    pub fn reported(&self) -> usize {
        self.done.iter().filter(|&&d| d).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(epoch: u64) -> Tag {
        Tag { attempt: 9, epoch }
    }

    #[test]
    fn waits_for_every_rank_and_drops_duplicates() {
        let mut a = Aggregation::new(9, vec![1, 1, 1]);
        assert_eq!(a.report(0, tag(1), RankReport::Done), Applied::Waiting);
        assert_eq!(a.report(0, tag(1), RankReport::Done), Applied::Duplicate);
        assert_eq!(a.reported(), 1, "a duplicate counts once");
        assert_eq!(a.report(2, tag(1), RankReport::Done), Applied::Waiting);
        assert_eq!(
            a.report(7, tag(1), RankReport::Done),
            Applied::Ignored,
            "no such rank"
        );
        assert_eq!(
            a.report(1, tag(1), RankReport::Done),
            Applied::Decided(Ok(()))
        );
        assert_eq!(
            a.report(1, tag(1), RankReport::Done),
            Applied::Ignored,
            "decided once"
        );
    }

    #[test]
    fn a_failure_ends_it_at_once_and_other_epochs_are_stale() {
        let mut a = Aggregation::new(9, vec![2, 5]);
        let gone = HandoffError::PeerGone {
            peer: "p".into(),
            reason: "killed".into(),
        };
        assert_eq!(
            a.report(1, tag(4), RankReport::Failed(gone.clone())),
            Applied::Stale,
            "a report from before rank 1's restart"
        );
        assert_eq!(
            a.report(1, tag(6), RankReport::Done),
            Applied::Stale,
            "nor from an epoch the hand-off was not opened in"
        );
        assert_eq!(a.report(0, tag(2), RankReport::Done), Applied::Waiting);
        assert_eq!(
            a.report(1, tag(5), RankReport::Failed(gone.clone())),
            Applied::Decided(Err(gone))
        );
        assert_eq!(a.report(1, tag(5), RankReport::Done), Applied::Ignored);
    }

    #[test]
    fn an_epoch_bump_fails_the_hand_offs_waiting_on_the_old_epoch() {
        let mut a = Aggregation::new(9, vec![3, 3]);
        assert_eq!(a.report(0, tag(3), RankReport::Done), Applied::Waiting);
        assert_eq!(a.epoch_bumped(1, 3), Applied::Ignored, "not newer");
        assert!(matches!(
            a.epoch_bumped(1, 4),
            Applied::Decided(Err(HandoffError::CacheLost(_)))
        ));
        assert_eq!(a.report(1, tag(3), RankReport::Done), Applied::Ignored);
    }
}
