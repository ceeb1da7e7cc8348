//! The bounded queue in front of a store's writer thread (the disk tier's, the shared store's):
//! writes that never wait on the actors' path, a waiting write for a stop, and a flush marker.

use super::{TierBlock, TierError};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

/// What a writer thread is sent.
pub(super) enum Job {
    /// Store a block.
    Write(Arc<TierBlock>),
    /// Answer once every job before this one ended.
    Flush(SyncSender<()>),
}

/// The sending side; dropping it ends the thread after the jobs already queued.
pub(super) struct WriteQueue(Mutex<Option<SyncSender<Job>>>);

impl WriteQueue {
    /// Starts thread `name` running `work` over a queue of `depth` jobs.
    ///
    /// # Errors
    /// [`TierError::Io`] when the thread cannot start.
    pub(super) fn spawn(
        name: &str,
        depth: usize,
        work: impl FnOnce(Receiver<Job>) + Send + 'static,
    ) -> Result<Self, TierError> {
        let (tx, rx) = sync_channel::<Job>(depth);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || work(rx))
            .map_err(TierError::Io)?;
        Ok(Self(Mutex::new(Some(tx))))
    }

    fn sender(&self) -> std::sync::MutexGuard<'_, Option<SyncSender<Job>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `b` unless the queue is full or closed; never waits. Whether it was queued.
    pub(super) fn try_write(&self, b: Arc<TierBlock>) -> bool {
        self.sender()
            .as_ref()
            .is_some_and(|tx| tx.try_send(Job::Write(b)).is_ok())
    }

    /// Queues `b`, waiting while the queue is full (a stop's persistence, off the async
    /// threads); `false` when the thread is gone.
    pub(super) fn write_waiting(&self, b: Arc<TierBlock>) -> bool {
        self.sender()
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Write(b)).is_ok())
    }

    /// Waits (at most `timeout`) until every job queued before this call has ended; `false`
    /// on a timeout or a stopped thread. Blocking.
    pub(super) fn flush(&self, timeout: std::time::Duration) -> bool {
        let (tx, rx) = sync_channel::<()>(1);
        // A waiting send: the marker must queue behind every write.
        let sent = self
            .sender()
            .as_ref()
            .is_some_and(|q| q.send(Job::Flush(tx)).is_ok());
        sent && rx.recv_timeout(timeout).is_ok()
    }
}

impl Drop for WriteQueue {
    fn drop(&mut self) {
        self.sender().take();
    }
}
