//! The memcpy executor of the `local` and `shm` backends: one dedicated thread
//! (`pdserve-memcpy-<engine>`) fed through a bounded queue, so callers never copy bytes
//! themselves.

use std::sync::atomic::{fence, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};

use crate::engine::{BatchState, PlannedOp};
use crate::error::{Result, TransportError};
use std::sync::Arc;

type Job = Box<dyn FnOnce() + Send>;

/// How long the copy thread keeps polling for the next job before it parks.
const SPIN_AFTER_JOB: std::time::Duration = std::time::Duration::from_micros(50);

/// Holds remote memory mapped while a copy runs.
pub(crate) type KeepAlive = Option<Arc<dyn std::any::Any + Send + Sync>>;

/// A dedicated copy thread; it exits when the executor is dropped.
#[derive(Debug)]
pub(crate) struct MemcpyExecutor {
    tx: SyncSender<Job>,
}

impl MemcpyExecutor {
    pub(crate) fn start(engine: &str, depth: usize) -> Result<Self> {
        let (tx, rx) = sync_channel::<Job>(depth);
        std::thread::Builder::new()
            .name(format!("pdserve-memcpy-{engine}"))
            .spawn(move || {
                // After a job the thread polls its queue for a short while before parking: waking
                // a parked thread costs tens of microseconds on this class of machine, more than
                // copying a megabyte (see docs/transport.md). The poll is bounded, so an idle
                // engine sleeps.
                while let Ok(job) = rx.recv() {
                    job();
                    let mut until = std::time::Instant::now() + SPIN_AFTER_JOB;
                    while std::time::Instant::now() < until {
                        match rx.try_recv() {
                            Ok(job) => {
                                job();
                                until = std::time::Instant::now() + SPIN_AFTER_JOB;
                            }
                            Err(std::sync::mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                        }
                    }
                }
            })?;
        Ok(Self { tx })
    }

    /// Queues a job without blocking.
    ///
    /// # Errors
    /// [`TransportError::Busy`] when the queue is full.
    pub(crate) fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<()> {
        match self.tx.try_send(Box::new(job)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                Err(TransportError::Busy("memcpy executor queue is full".into()))
            }
            Err(TrySendError::Disconnected(_)) => Err(TransportError::peer_gone(
                "local engine",
                "memcpy executor stopped",
            )),
        }
    }
}

/// Where the other end of a memcpy piece is.
pub(crate) trait RemotePointers: Send + Sync {
    /// Pointer to `len` bytes at `offset` of the remote region, checked, with whatever keeps
    /// that memory alive while the copy runs; or why not.
    fn remote_ptr(&self, region: u64, offset: u64, len: u64) -> Result<(*mut u8, KeepAlive)>;
    /// Whether the peer is still there.
    fn peer_alive(&self) -> Result<()>;
}

/// Runs the pieces of one batch as copies, checking liveness and cancellation between pieces.
/// A write's bytes are published with a release fence before the piece completes.
pub(crate) fn run_pieces(
    pieces: Vec<PlannedOp>,
    batch: Arc<BatchState>,
    remote: &dyn RemotePointers,
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
            // Under the batch's landing fence: once the batch has ended (timed out,
            // cancelled, failed) no copy of it runs any more, on either side's memory.
            let landed = batch.land(|| {
                // SAFETY: both ranges were checked (local at submit, remote just now) and
                // their memory is kept mapped by `op.local` and the peer mapping; batches
                // never overlap source and destination (distinct regions or disjoint ranges
                // by contract; `copy` tolerates overlap anyway).
                unsafe {
                    match op.kind {
                        crate::engine::OpKind::Write => std::ptr::copy(lptr, rptr, op.len as usize),
                        crate::engine::OpKind::Read => {
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
