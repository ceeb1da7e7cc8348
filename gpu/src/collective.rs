//! Collectives joining the tensor-parallel ranks of one model.
//!
//! On CPU each rank is its own OS thread and [`ThreadCollective`] joins them through shared
//! memory. Reductions add the ranks' contributions in rank order on every rank, so every rank
//! ends with bit-identical values.

use crate::{ModelError, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Communication between the ranks of one tensor-parallel group.
pub trait Collective: Send + Sync {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank with the element-wise sum over ranks.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when another rank failed or the group timed out.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `local`, in rank order, concatenated.
    ///
    /// # Errors
    /// As [`Collective::all_reduce_sum`].
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;
    /// Marks the group failed so ranks waiting in a collective return an error at once.
    fn poison(&self, reason: &str);
}

/// The trivial group of one rank.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
    fn poison(&self, _reason: &str) {}
}

#[derive(Debug)]
struct Exchange {
    generation: u64,
    arrived: usize,
    contributions: Vec<Option<Vec<f32>>>,
    last_result: Arc<Vec<Vec<f32>>>,
    poisoned: Option<String>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    state: Mutex<Exchange>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank's end of a group of threads in one process.
#[derive(Debug, Clone)]
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadCollective {
    /// Creates the `size` ends of one group; a rank that waits longer than `timeout` for the
    /// others fails with [`ModelError::RankFailed`].
    pub fn group(size: usize, timeout: Duration) -> Vec<ThreadCollective> {
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(Exchange {
                generation: 0,
                arrived: 0,
                contributions: vec![None; size],
                last_result: Arc::new(Vec::new()),
                poisoned: None,
            }),
            cv: Condvar::new(),
            timeout,
        });
        (0..size)
            .map(|rank| ThreadCollective {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Clears a poisoned group so it can run again once every rank has left the failed step.
    pub fn reset(&self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.poisoned = None;
        st.arrived = 0;
        st.contributions.iter_mut().for_each(|c| *c = None);
        st.generation += 1;
    }

    fn exchange(&self, local: Vec<f32>) -> Result<Arc<Vec<Vec<f32>>>> {
        let fail = |reason: String| ModelError::RankFailed {
            rank: self.rank,
            reason,
        };
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &st.poisoned {
            return Err(fail(format!("group failed: {p}")));
        }
        let gen = st.generation;
        st.contributions[self.rank] = Some(local);
        st.arrived += 1;
        if st.arrived == self.shared.size {
            let all: Vec<Vec<f32>> = st
                .contributions
                .iter_mut()
                .map(|c| c.take().unwrap_or_default())
                .collect();
            st.last_result = Arc::new(all);
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st.last_result.clone());
        }
        let (st, wait) = self
            .shared
            .cv
            .wait_timeout_while(st, self.shared.timeout, |s| {
                s.generation == gen && s.poisoned.is_none()
            })
            .unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &st.poisoned {
            return Err(fail(format!("group failed: {p}")));
        }
        if wait.timed_out() {
            return Err(fail(format!(
                "collective timed out after {:?}",
                self.shared.timeout
            )));
        }
        Ok(st.last_result.clone())
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if self.shared.size == 1 {
            return Ok(());
        }
        let all = self.exchange(buf.to_vec())?;
        buf.copy_from_slice(&all[0]);
        for part in &all[1..] {
            for (b, p) in buf.iter_mut().zip(part) {
                *b += p;
            }
        }
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        if self.shared.size == 1 {
            return Ok(local.to_vec());
        }
        let all = self.exchange(local.to_vec())?;
        Ok(all.iter().flatten().copied().collect())
    }
    fn poison(&self, reason: &str) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.poisoned = Some(reason.to_string());
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        let group = ThreadCollective::group(3, Duration::from_secs(10));
        let handles: Vec<_> = group
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut out = Vec::new();
                    for round in 0..50 {
                        let mut buf = vec![c.rank() as f32 + round as f32; 4];
                        c.all_reduce_sum(&mut buf).unwrap();
                        let g = c.all_gather(&[c.rank() as f32]).unwrap();
                        out.push((buf, g));
                    }
                    out
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (round, (buf, g)) in results[0].iter().enumerate() {
            assert_eq!(buf, &vec![3.0 + 3.0 * round as f32; 4]);
            assert_eq!(g, &vec![0.0, 1.0, 2.0]);
        }
        assert_eq!(results[0], results[1]);
        assert_eq!(results[1], results[2]);
    }

    #[test]
    fn poison_releases_waiting_ranks_and_timeout_fires() {
        let group = ThreadCollective::group(2, Duration::from_secs(30));
        let waiter = group[0].clone();
        let h = std::thread::spawn(move || waiter.all_reduce_sum(&mut [1.0]));
        group[1].poison("rank 1 crashed");
        let err = h.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("rank 1 crashed"), "{err}");

        let lonely = ThreadCollective::group(2, Duration::from_millis(50));
        let err = lonely[0].all_reduce_sum(&mut [1.0]).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    }
}
