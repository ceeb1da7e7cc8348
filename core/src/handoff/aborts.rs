//! The memory of recently aborted hand-offs: an abort may arrive before the prompt it names
//! (the decode side gave up while its Prefill request was on the way), so both the peer
//! service and the Scheduler remember aborted `transfer_id`s for [`ABORT_MEMORY`] and refuse a
//! late request for one.
//!
//! Abort ids come from peers, so the memory is bounded: at most [`MAX_REMEMBERED_ABORTS`]
//! ids, the oldest forgotten first, and every operation is O(1) amortized (ids leave in
//! the order they came), never a scan of the whole map.

use pdserve_runtime::ids::TransferId;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How long an aborted hand-off is remembered (a late Prefill request for it is refused).
pub const ABORT_MEMORY: Duration = Duration::from_secs(600);

/// Most aborted ids remembered at once. A decode instance aborts the hand-offs it gives up,
/// a few per second at most; a flood of forged aborts only pushes out the oldest.
pub const MAX_REMEMBERED_ABORTS: usize = 1 << 16;

/// Recently aborted hand-offs, bounded in time and count.
#[derive(Debug)]
pub struct RecentAborts {
    /// Each id's latest abort: its sequence number and time.
    at: HashMap<TransferId, (u64, Instant)>,
    /// Aborts in order; an entry whose sequence number is no longer its id's latest is
    /// stale (the id was aborted again) and skipped.
    order: VecDeque<(u64, Instant, TransferId)>,
    next: u64,
    memory: Duration,
    capacity: usize,
}

impl Default for RecentAborts {
    fn default() -> Self {
        Self::new(ABORT_MEMORY, MAX_REMEMBERED_ABORTS)
    }
}

impl RecentAborts {
    /// A memory of `capacity` ids for `memory` each.
    pub fn new(memory: Duration, capacity: usize) -> Self {
        Self {
            at: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            memory,
            capacity: capacity.max(1),
        }
    }

    /// Remembers `transfer` as aborted at `now`.
    pub fn insert(&mut self, transfer: TransferId, now: Instant) {
        self.forget_expired(now);
        let seq = self.next;
        self.next += 1;
        self.at.insert(transfer, (seq, now));
        self.order.push_back((seq, now, transfer));
        while self.at.len() > self.capacity {
            self.pop_oldest();
        }
        if self.order.len() > 2 * self.capacity {
            // Stale entries of re-aborted ids: dropped once they are half the queue, so
            // each insert pays O(1) amortized.
            let at = &self.at;
            self.order
                .retain(|&(seq, _, id)| at.get(&id).is_some_and(|&(s, _)| s == seq));
        }
    }

    /// Whether `transfer` was aborted less than the memory's span before `now`.
    pub fn contains(&self, transfer: TransferId, now: Instant) -> bool {
        self.at
            .get(&transfer)
            .is_some_and(|&(_, at)| now.saturating_duration_since(at) < self.memory)
    }

    /// Forgets the ids aborted a memory's span or more before `now`.
    pub fn forget_expired(&mut self, now: Instant) {
        while self
            .order
            .front()
            .is_some_and(|&(_, at, _)| now.saturating_duration_since(at) >= self.memory)
        {
            self.pop_oldest();
        }
    }

    /// Ids remembered.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    fn pop_oldest(&mut self) {
        if let Some((seq, _, id)) = self.order.pop_front() {
            // Only the id's latest entry removes it (a stale one of a re-abort does not).
            if self.at.get(&id).is_some_and(|&(s, _)| s == seq) {
                self.at.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_are_forgotten_after_the_memory_and_past_the_capacity() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut m = RecentAborts::new(s(10), 3);
        m.insert(TransferId(1), t0);
        assert!(m.contains(TransferId(1), t0 + s(9)));
        assert!(!m.contains(TransferId(1), t0 + s(10)), "memory over");
        m.insert(TransferId(2), t0 + s(1));
        m.insert(TransferId(3), t0 + s(2));
        m.insert(TransferId(4), t0 + s(3));
        assert_eq!(m.len(), 3, "capacity");
        assert!(
            !m.contains(TransferId(1), t0 + s(3)),
            "the oldest went first"
        );
        assert!(m.contains(TransferId(4), t0 + s(3)));
        m.forget_expired(t0 + s(12));
        assert_eq!(m.len(), 1, "ids of t0+1 and t0+2 expired: {m:?}");
        assert!(m.contains(TransferId(4), t0 + s(12)));
    }

    proptest! {
        /// Against a plain map with the same rules: same answers, and never more than the
        /// capacity in the map or twice it in the queue.
        #[test]
        fn matches_a_plain_model(ops in proptest::collection::vec((0u128..8, 0u64..4, any::<bool>()), 1..200)) {
            let t0 = Instant::now();
            let (memory, capacity) = (Duration::from_secs(5), 4);
            let mut m = RecentAborts::new(memory, capacity);
            let mut model: Vec<(TransferId, Instant)> = Vec::new(); // insertion order, latest per id
            let mut now = t0;
            for (id, step, insert) in ops {
                now += Duration::from_secs(step);
                let id = TransferId(id);
                if insert {
                    model.retain(|&(_, at)| now.duration_since(at) < memory);
                    model.retain(|&(i, _)| i != id);
                    model.push((id, now));
                    while model.len() > capacity {
                        model.remove(0);
                    }
                    m.insert(id, now);
                }
                let expect = model.iter().any(|&(i, at)| i == id && now.duration_since(at) < memory);
                prop_assert_eq!(m.contains(id, now), expect);
                prop_assert!(m.len() <= capacity);
                prop_assert!(m.order.len() <= 2 * capacity);
            }
        }
    }
}
