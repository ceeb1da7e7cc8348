//! The memcpy executor of the `local` and `shm` backends: `memcpy_threads` dedicated threads
//! (`pdserve-memcpy-<engine>`) sharing one bounded queue, so callers never copy bytes
//! themselves. A batch of several pieces is cut into one job per thread ([`run_batch`]), so a
//! large transfer is copied by all of them at once; batches of one piece spread over the
//! threads by themselves.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::batch::BatchState;
use crate::error::{Result, TransportError};
use crate::plan::PlannedOp;
use std::sync::Arc;

type Job = Box<dyn FnOnce() + Send>;

/// How long a copy thread keeps polling for the next job before it parks.
const SPIN_AFTER_JOB: std::time::Duration = std::time::Duration::from_micros(50);

/// Holds remote memory mapped while a copy runs.
pub(crate) type KeepAlive = Option<Arc<dyn std::any::Any + Send + Sync>>;

/// A gate the copy threads pass before each piece: open unless a [`CopyHold`] is alive.
/// Fault injection for tests (see [`crate::TransferEngine::hold_copies`]): it makes a copy
/// slow by construction instead of sizing work against a wall clock.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// Holds alive; the flag lets an open gate cost one atomic load.
    held: AtomicUsize,
    holds: Mutex<usize>,
    opened: Condvar,
}

impl Gate {
    /// Returns at once while open; otherwise parks until every hold is released.
    fn pass(&self) {
        if self.held.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        while *holds > 0 {
            holds = self.opened.wait(holds).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Keeps an engine's copy threads from starting their next piece until dropped (see
/// [`crate::TransferEngine::hold_copies`]).
#[derive(Debug)]
#[must_use = "the copies are held only while the guard is alive"]
pub struct CopyHold {
    gate: Arc<Gate>,
}

impl Drop for CopyHold {
    fn drop(&mut self) {
        let mut holds = self.gate.holds.lock().unwrap_or_else(|e| e.into_inner());
        *holds -= 1;
        self.gate.held.store(*holds, Ordering::Release);
        drop(holds);
        self.gate.opened.notify_all();
    }
}

/// The queue the copy threads share.
#[derive(Default)]
struct Queue {
    jobs: Mutex<Jobs>,
    /// Jobs queued, readable without the lock (a polling thread looks before locking).
    queued: AtomicUsize,
    ready: Condvar,
}

#[derive(Default)]
struct Jobs {
    jobs: VecDeque<Job>,
    /// Threads waiting on `ready` (changed under the lock): a submit wakes only when some are.
    parked: usize,
    closed: bool,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Jobs> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The front job of `q` (locked), keeping `queued` in step.
    fn take_front(&self, q: &mut Jobs) -> Option<Job> {
        let job = q.jobs.pop_front();
        if job.is_some() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        job
    }

    fn try_pop(&self) -> Option<Job> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.take_front(&mut self.lock())
    }

    /// The next job, parking until there is one; `None` once the executor is dropped and the
    /// queue is drained.
    fn pop_or_park(&self) -> Option<Job> {
        let mut q = self.lock();
        loop {
            if let Some(job) = self.take_front(&mut q) {
                return Some(job);
            }
            if q.closed {
                return None;
            }
            q.parked += 1;
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            q.parked -= 1;
        }
    }

    /// The worker loop. After a job the thread polls the queue for a short while before it
    /// parks: waking a parked thread costs tens of microseconds on this class of machine, more
    /// than copying a megabyte (see docs/transport.md). The poll is bounded, so an idle
    /// engine sleeps.
    fn work(&self) {
        while let Some(job) = self.pop_or_park() {
            job();
            let mut until = std::time::Instant::now() + SPIN_AFTER_JOB;
            while std::time::Instant::now() < until {
                match self.try_pop() {
                    Some(job) => {
                        job();
                        until = std::time::Instant::now() + SPIN_AFTER_JOB;
                    }
                    None => std::hint::spin_loop(),
                }
            }
        }
    }
}

/// Dedicated copy threads; they finish the queued jobs and exit when the executor is dropped.
pub(crate) struct MemcpyExecutor {
    queue: Arc<Queue>,
    gate: Arc<Gate>,
    threads: usize,
    depth: usize,
}

impl std::fmt::Debug for MemcpyExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemcpyExecutor")
            .field("threads", &self.threads)
            .field("depth", &self.depth)
            .field("queued", &self.queue.queued.load(Ordering::Relaxed))
            .finish()
    }
}

impl MemcpyExecutor {
    /// Starts `threads` copy threads sharing a queue of at most `depth` jobs.
    pub(crate) fn start(engine: &str, threads: usize, depth: usize) -> Result<Self> {
        let threads = threads.max(1);
        let queue = Arc::new(Queue::default());
        for _ in 0..threads {
            let q = queue.clone();
            std::thread::Builder::new()
                .name(format!("pdserve-memcpy-{engine}"))
                .spawn(move || q.work())?;
        }
        Ok(Self {
            queue,
            gate: Arc::default(),
            threads,
            depth,
        })
    }

    /// Holds the copy threads before their next piece until the guard is dropped.
    pub(crate) fn hold(&self) -> CopyHold {
        let mut holds = self.gate.holds.lock().unwrap_or_else(|e| e.into_inner());
        *holds += 1;
        self.gate.held.store(*holds, Ordering::Release);
        CopyHold {
            gate: self.gate.clone(),
        }
    }

    /// Copy threads.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Queues the jobs, all or none, without blocking.
    ///
    /// # Errors
    /// [`TransportError::Busy`] when they do not all fit in the queue.
    fn submit_all(&self, jobs: Vec<Job>) -> Result<()> {
        let mut q = self.queue.lock();
        if q.closed {
            return Err(TransportError::peer_gone(
                "local engine",
                "memcpy executor stopped",
            ));
        }
        if q.jobs.len() + jobs.len() > self.depth {
            return Err(TransportError::Busy("memcpy executor queue is full".into()));
        }
        let n = jobs.len();
        q.jobs.extend(jobs);
        self.queue.queued.fetch_add(n, Ordering::AcqRel);
        let parked = q.parked;
        drop(q);
        match (parked, n) {
            (0, _) => {}
            (_, 1) => self.queue.ready.notify_one(),
            _ => self.queue.ready.notify_all(),
        }
        Ok(())
    }

    /// Queues one job without blocking.
    ///
    /// # Errors
    /// [`TransportError::Busy`] when the queue is full.
    #[cfg(test)]
    pub(crate) fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<()> {
        self.submit_all(vec![Box::new(job)])
    }
}

impl Drop for MemcpyExecutor {
    fn drop(&mut self) {
        self.queue.lock().closed = true;
        self.queue.ready.notify_all();
    }
}

/// Queues the pieces of one batch as copies: cut into as many contiguous runs as there are
/// copy threads (one run for a batch of one piece), each run a job of [`run_pieces`].
///
/// # Errors
/// [`TransportError::Busy`] when the runs do not all fit in the queue (none is queued).
pub(crate) fn run_batch(
    executor: &MemcpyExecutor,
    pieces: Vec<PlannedOp>,
    batch: Arc<BatchState>,
    remote: Arc<dyn RemotePointers>,
) -> Result<()> {
    let per_run = pieces.len().div_ceil(executor.threads()).max(1);
    let mut jobs: Vec<Job> = Vec::with_capacity(executor.threads());
    let mut pieces = pieces.into_iter().peekable();
    while pieces.peek().is_some() {
        let run: Vec<PlannedOp> = pieces.by_ref().take(per_run).collect();
        let (batch, remote, gate) = (batch.clone(), remote.clone(), executor.gate.clone());
        jobs.push(Box::new(move || run_pieces(run, batch, &*remote, &gate)));
    }
    executor.submit_all(jobs)
}

/// Where the other end of a memcpy piece is.
pub(crate) trait RemotePointers: Send + Sync {
    /// Pointer to `len` bytes at `offset` of the remote region, checked, with whatever keeps
    /// that memory alive while the copy runs; or why not.
    fn remote_ptr(&self, region: u64, offset: u64, len: u64) -> Result<(*mut u8, KeepAlive)>;
    /// Whether the peer is still there.
    fn peer_alive(&self) -> Result<()>;
}

/// Runs pieces of one batch as copies, checking liveness and cancellation between pieces;
/// each copy passes `gate` (a test's [`CopyHold`]) just before it lands.
/// A write's bytes are published with a release fence before the piece completes. Several
/// runs of one batch may go at once: once one fails, the batch's landing fence stops the
/// others' copies.
pub(crate) fn run_pieces(
    pieces: Vec<PlannedOp>,
    batch: Arc<BatchState>,
    remote: &dyn RemotePointers,
    gate: &Gate,
) {
    for op in pieces {
        if batch.is_cancelled() {
            return;
        }
        let res = remote.peer_alive().and_then(|()| {
            // A region that vanished because the peer died between the two checks is the
            // peer's death, not an unknown region: report it as such.
            let (rptr, _keep) = remote
                .remote_ptr(op.remote_region, op.remote_offset, op.len)
                .map_err(|e| remote.peer_alive().err().unwrap_or(e))?;
            let lptr = op.local.ptr_at(op.local_offset);
            // A held piece waits here, past every check but the landing fence: the copy that
            // was already under way when its batch was given up.
            gate.pass();
            // Under the batch's landing fence: once the batch has ended (timed out,
            // cancelled, failed) no copy of it runs any more, on either side's memory.
            let landed = batch.land(|| {
                // SAFETY: both ranges were checked (local at submit, remote just now) and
                // their memory is kept mapped by `op.local` and the peer mapping; batches
                // never overlap source and destination (distinct regions or disjoint ranges
                // by contract; `copy` tolerates overlap anyway).
                unsafe {
                    match op.kind {
                        crate::op::OpKind::Write => std::ptr::copy(lptr, rptr, op.len as usize),
                        crate::op::OpKind::Read => {
                            fence(Ordering::Acquire);
                            std::ptr::copy(rptr, lptr, op.len as usize)
                        }
                    }
                }
                fence(Ordering::Release);
            });
            if landed {
                Ok(())
            } else {
                Err(TransportError::Cancelled)
            }
        });
        let failed = res.is_err();
        batch.complete(res);
        if failed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn jobs_run_on_several_threads_at_once() {
        let ex = MemcpyExecutor::start("t", 3, 16).unwrap();
        // Three jobs that each wait for all three: they finish only if they run together.
        let barrier = Arc::new(std::sync::Barrier::new(3));
        let (tx, rx) = mpsc::channel();
        for _ in 0..3 {
            let (b, tx) = (barrier.clone(), tx.clone());
            ex.submit(move || {
                b.wait();
                tx.send(std::thread::current().id()).unwrap();
            })
            .unwrap();
        }
        let mut ids: Vec<_> = (0..3)
            .map(|_| {
                rx.recv_timeout(Duration::from_secs(10))
                    .expect("jobs did not run together")
            })
            .collect();
        ids.sort_by_key(|id| format!("{id:?}"));
        ids.dedup();
        assert_eq!(ids.len(), 3);
    }

    #[test]
    fn a_group_that_does_not_fit_is_refused_whole_and_the_queue_keeps_serving() {
        let ex = MemcpyExecutor::start("t", 1, 2).unwrap();
        // Hold the only thread so that queued jobs stay queued.
        let (release, held) = mpsc::channel::<()>();
        let (started_tx, started) = mpsc::channel();
        ex.submit(move || {
            started_tx.send(()).unwrap();
            held.recv().unwrap();
        })
        .unwrap();
        started.recv_timeout(Duration::from_secs(10)).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let job = |ran: &Arc<AtomicUsize>| -> Job {
            let ran = ran.clone();
            Box::new(move || {
                ran.fetch_add(1, Ordering::SeqCst);
            })
        };
        ex.submit_all(vec![job(&ran)]).unwrap();
        let busy = ex.submit_all(vec![job(&ran), job(&ran)]).unwrap_err();
        assert!(matches!(busy, TransportError::Busy(_)), "{busy:?}");
        assert_eq!(
            ex.queue.queued.load(Ordering::SeqCst),
            1,
            "nothing of the refused group is queued"
        );
        ex.submit_all(vec![job(&ran)]).unwrap();
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ran.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn dropping_the_executor_still_runs_what_was_queued() {
        let ex = MemcpyExecutor::start("t", 2, 64).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel::<()>();
        for _ in 0..32 {
            let (ran, tx) = (ran.clone(), tx.clone());
            ex.submit(move || {
                std::thread::sleep(Duration::from_micros(200));
                ran.fetch_add(1, Ordering::SeqCst);
                drop(tx);
            })
            .unwrap();
        }
        drop(tx);
        drop(ex);
        // Every job's sender is dropped only after it ran; the channel closes when all have.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Err(mpsc::RecvTimeoutError::Disconnected)
        );
        assert_eq!(ran.load(Ordering::SeqCst), 32);
    }
}
