//! A submitted batch as the executors complete it and its owner observes it: the shared
//! [`BatchState`] (with its landing fence), the per-piece [`PieceCompletion`] guard, and the
//! caller's [`BatchHandle`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Result, TransportError};
use crate::plan::PlannedOp;

/// State of a batch: what the executors complete and the handle observes.
#[derive(Debug)]
pub(crate) struct BatchState {
    total: usize,
    done: AtomicUsize,
    /// The first error. Its lock is also the landing fence: bytes land in local memory
    /// under a read lock ([`BatchState::land`]) and the error is set under the write lock,
    /// so once a batch has failed no byte lands any more.
    error: RwLock<Option<TransportError>>,
    cancelled: AtomicBool,
    finished: watch::Sender<bool>,
}

impl BatchState {
    pub(crate) fn new(total: usize) -> Arc<Self> {
        let (finished, _) = watch::channel(total == 0);
        Arc::new(Self {
            total,
            done: AtomicUsize::new(0),
            error: RwLock::new(None),
            cancelled: AtomicBool::new(false),
            finished,
        })
    }

    /// Records the end of one piece. The piece's bytes are written before this is called; the
    /// counter's release/acquire makes them visible to whoever observes the batch as done.
    pub(crate) fn complete(&self, result: Result<()>) {
        match result {
            Ok(()) => {
                if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.total {
                    self.finished.send_replace(true);
                }
            }
            Err(e) => {
                let mut slot = self.error.write().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(e);
                }
                drop(slot);
                self.finished.send_replace(true);
            }
        }
    }

    /// Ends the batch with `why` and stops its remaining pieces. The error is recorded before
    /// the flag is raised: an executor that sees the flag first would record its own
    /// `Cancelled` and hide why the batch was given up (a timeout, for one).
    fn abandon(&self, why: TransportError) {
        self.complete(Err(why));
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Copies received bytes into local memory with `copy` unless the batch has already
    /// ended in failure or been given up; returns whether it copied. A copy runs to its end
    /// before a failure can be recorded, so once [`BatchHandle::wait`] or
    /// [`BatchHandle::cancel`] returned, no byte of this batch lands in local memory: the
    /// caller may reuse it. (Bytes a late answer brings are read off the wire and dropped.)
    pub(crate) fn land(&self, copy: impl FnOnce()) -> bool {
        let error = self.error.read().unwrap_or_else(|e| e.into_inner());
        if error.is_some() || self.cancelled.load(Ordering::Relaxed) {
            return false;
        }
        copy();
        true
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
            || self
                .error
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    fn status(&self) -> BatchStatus {
        if let Some(e) = self.error.read().unwrap_or_else(|e| e.into_inner()).clone() {
            return BatchStatus::Failed(e);
        }
        let done = self.done.load(Ordering::Acquire);
        if done == self.total {
            BatchStatus::Done
        } else {
            BatchStatus::Pending {
                completed: done,
                total: self.total,
            }
        }
    }
}

/// Completes its piece with an error if dropped unfinished (a queue torn down with the
/// connection), so no batch waits for a piece that will never run.
#[derive(Debug)]
pub(crate) struct PieceCompletion {
    batch: Option<Arc<BatchState>>,
    peer: Arc<str>,
}

impl PieceCompletion {
    pub(crate) fn new(batch: Arc<BatchState>, peer: Arc<str>) -> Self {
        Self {
            batch: Some(batch),
            peer,
        }
    }
    pub(crate) fn is_cancelled(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| b.is_cancelled())
    }
    /// Copies a read answer (`bytes`, `op.len` of them) into `op`'s local range under the
    /// batch's landing fence ([`BatchState::land`]); `Cancelled` when the batch has ended.
    pub(crate) fn land_read(&self, op: &PlannedOp, bytes: &[u8]) -> Result<()> {
        assert!(
            bytes.len() as u64 >= op.len,
            "a read answer shorter than its piece"
        );
        self.land_read_at(op, 0, &bytes[..op.len as usize])
    }

    /// As [`PieceCompletion::land_read`] for the part of the answer at `at` (`bytes` must fit
    /// inside the piece).
    pub(crate) fn land_read_at(&self, op: &PlannedOp, at: usize, bytes: &[u8]) -> Result<()> {
        assert!(
            at as u64 + bytes.len() as u64 <= op.len,
            "a read answer longer than its piece"
        );
        let landed = self.batch.as_ref().is_some_and(|b| {
            b.land(|| {
                // SAFETY: the local range was checked at submit; `op.local` keeps the region
                // alive; the batch owns these bytes until it ends, and it has not ended.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        op.local.ptr_at(op.local_offset + at as u64),
                        bytes.len(),
                    );
                }
            })
        });
        if landed {
            Ok(())
        } else {
            Err(TransportError::Cancelled)
        }
    }
    pub(crate) fn complete(mut self, result: Result<()>) {
        if let Some(b) = self.batch.take() {
            b.complete(result);
        }
    }
}

impl Drop for PieceCompletion {
    fn drop(&mut self) {
        if let Some(b) = self.batch.take() {
            b.complete(Err(TransportError::peer_gone(
                &*self.peer,
                "connection closed before the operation finished",
            )));
        }
    }
}

/// Where a batch stands.
#[derive(Debug, Clone)]
pub enum BatchStatus {
    /// Still running.
    Pending {
        /// Pieces finished.
        completed: usize,
        /// Pieces in all.
        total: usize,
    },
    /// Every operation finished; written bytes are visible at the receiver.
    Done,
    /// An operation failed (the first error); other pieces may or may not have landed.
    Failed(TransportError),
}

/// A submitted batch.
#[derive(Debug, Clone)]
pub struct BatchHandle {
    state: Arc<BatchState>,
    bytes: u64,
}

impl BatchHandle {
    pub(crate) fn new(state: Arc<BatchState>, bytes: u64) -> Self {
        Self { state, bytes }
    }

    /// Polls the batch without waiting.
    pub fn status(&self) -> BatchStatus {
        self.state.status()
    }

    /// Bytes the batch moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Asks the executors to stop at the next piece boundary; the batch then fails with
    /// [`TransportError::Cancelled`]. Pieces already on the wire may still land.
    pub fn cancel(&self) {
        self.state.abandon(TransportError::Cancelled);
    }

    /// Waits until the batch ends or `timeout` passes. On timeout the batch is cancelled.
    ///
    /// # Errors
    /// [`TransportError::Timeout`], or the batch's first error (typed: unknown region, out of
    /// bounds, peer gone, ...).
    pub async fn wait(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.state.finished.subscribe();
        let finished = tokio::time::timeout(timeout, rx.wait_for(|f| *f)).await;
        if finished.is_err() {
            self.state.abandon(TransportError::Timeout {
                what: "transfer batch".into(),
                after: timeout,
            });
        }
        match self.status() {
            BatchStatus::Done => Ok(()),
            BatchStatus::Failed(e) => Err(e),
            BatchStatus::Pending { .. } => Err(TransportError::Timeout {
                what: "transfer batch".into(),
                after: timeout,
            }),
        }
    }

    /// Blocking wait for code outside async contexts (benchmarks, tools).
    ///
    /// # Errors
    /// As [`BatchHandle::wait`].
    pub fn wait_blocking(&self, timeout: Duration) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        rt.block_on(self.wait(timeout))
    }
}
