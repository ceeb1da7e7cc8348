//! Tensor parallelism on CPU: one named OS thread per rank, each owning its model shard and
//! its KV cache, fed through bounded channels.
//!
//! [`TpGroup::step`] hands the same [`Batch`] to every rank and returns rank 0's logits. A rank
//! that fails or panics poisons the group's collective, so the others stop waiting at once;
//! the step fails with [`ModelError::RankFailed`] and the group is usable again afterwards.

use crate::batch::Batch;
use crate::collective::{Collective, ThreadCollective};
use crate::config::ModelConfig;
use crate::kv::{KvCache, KvLayout};
use crate::model::ModelShard;
use crate::weights::{TensorStore, WeightFormat};
use crate::{ModelError, Result};
use pdserve_runtime::memory::HostMemoryAllocator;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a rank waits for its peers inside one collective before the step fails.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// Called with `(rank, layer)` once a layer's K/V of the current step are in that rank's cache.
pub type LayerHook = Arc<dyn Fn(usize, usize) + Send + Sync>;

/// Called with `(rank, layer, cache)` during a step, once the batch's K/V of `layer` are in
/// that rank's cache and before attention reads the layer: it may write other blocks'
/// `layer` into the cache (KV restored from a tier layer by layer, waiting for the layer to
/// arrive). Only the CPU executor runs one.
pub type KvFeed = Arc<dyn Fn(usize, usize, &mut KvCache) + Send + Sync>;

/// A job on a rank's KV cache, run on the rank thread between steps (in queue order).
pub type KvJob = Box<dyn FnOnce(&mut KvCache) + Send>;

/// Receives the outcome of one forward step on one rank (logits of rank 0; every rank returns
/// the same values). Runs on the rank's thread: keep it short (send a message).
pub type StepCallback = Box<dyn FnOnce(Result<Vec<Vec<f32>>>) + Send>;

/// Called once when a KV upload (host mirror → the rank's private cache) ended, on the rank's
/// side (a device-backed executor's thread): the ranks of the CUDA executor and of the
/// actors' CPU stand-in of it.
pub type UploadCallback = Box<dyn FnOnce(Result<()>) + Send>;

enum Job {
    Forward {
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        feed: Option<KvFeed>,
        done: StepCallback,
    },
    WithKv {
        job: KvJob,
    },
}

/// What to build a group from.
#[derive(Clone, Debug)]
pub struct TpOptions {
    /// Number of ranks.
    pub tp: usize,
    /// KV blocks per rank.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// In-memory weight format.
    pub format: WeightFormat,
    /// Element type of the KV cache.
    pub kv_dtype: crate::kv::KvDtype,
}

impl TpOptions {
    /// The KV layout of one rank of `config` split over `self.tp` ranks (its share of the
    /// KV heads), with `self.kv_dtype` elements.
    pub fn rank_layout(&self, config: &ModelConfig) -> KvLayout {
        KvLayout {
            num_layers: config.num_layers,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            num_kv_heads: config.num_kv_heads / self.tp,
            head_dim: config.head_dim,
            dtype: self.kv_dtype,
        }
    }
}

/// Jobs a rank thread may have queued beyond the one it runs (bounded: a caller that gets
/// ahead is told so instead of queueing without limit).
const RANK_QUEUE: usize = 16;

/// One tensor-parallel rank: a named OS thread (`pdserve-tp{rank}`) that owns the rank's model
/// shard and KV cache and runs the jobs it is sent, reporting through callbacks.
pub struct RankExecutor {
    thread: RankThread<Job>,
    layout: KvLayout,
}

/// A rank's job queue and thread, as every backend's rank executor drives it (the CPU
/// [`RankExecutor`], the CUDA executor, the actors' CPU stand-in of it): a named thread
/// serving a bounded queue, bounded sends that fail instead of waiting, the group's
/// collective to poison and reset, and a drop that closes the queue without joining the
/// thread.
pub struct RankThread<J> {
    rank: usize,
    jobs: Option<SyncSender<J>>,
    thread: Option<JoinHandle<()>>,
    comm: ThreadCollective,
}

impl<J: Send + 'static> RankThread<J> {
    /// Starts rank `comm.rank()`'s thread, named `name`, running `serve` on a queue of at most
    /// `queue` jobs beyond the one in hand; `serve` should return once the queue closes (the
    /// executor dropped).
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub fn spawn(
        name: String,
        queue: usize,
        comm: ThreadCollective,
        serve: impl FnOnce(Receiver<J>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<J>(queue);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || serve(rx))?;
        Ok(Self {
            rank: comm.rank(),
            jobs: Some(tx),
            thread: Some(thread),
            comm,
        })
    }
}

impl<J> RankThread<J> {
    /// The rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Fails every collective the group is waiting in (a peer rank died).
    pub fn poison(&self, reason: &str) {
        self.comm.poison(reason);
    }

    /// Clears a poisoned collective once no rank is inside a step.
    pub fn reset(&self) {
        self.comm.reset();
    }

    /// The rank's failure, for `reason`.
    pub fn gone(&self, reason: &str) -> ModelError {
        ModelError::RankFailed {
            rank: self.rank,
            reason: reason.into(),
        }
    }

    /// Queues `job`; a full queue or a gone thread is an error, never a wait.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone (or the
    /// executor is shutting down).
    pub fn send(&self, job: J) -> Result<()> {
        let tx = self
            .jobs
            .as_ref()
            .ok_or_else(|| self.gone("rank is shutting down"))?;
        tx.try_send(job).map_err(|e| match e {
            std::sync::mpsc::TrySendError::Full(_) => self.gone("rank queue is full"),
            std::sync::mpsc::TrySendError::Disconnected(_) => self.gone("rank thread is gone"),
        })
    }
}

impl<J> RankThread<J> {
    /// Closes the queue and waits for the thread to end (the job in hand, then `serve`'s own
    /// shutdown). For owners that may block, such as a command-line run about to exit: a
    /// process that exits while a rank thread still tears down its device state races the
    /// driver's own teardown.
    pub fn join(mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!(rank = self.rank, "a rank thread panicked");
            }
        }
    }
}

impl<J> Drop for RankThread<J> {
    fn drop(&mut self) {
        // Closing the channel ends the loop once the job in hand is done. The thread is not
        // joined: a dying owner (an actor on an async thread) must not wait on compute.
        self.jobs = None;
        drop(self.thread.take());
    }
}

impl std::fmt::Debug for RankExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankExecutor")
            .field("rank", &self.thread.rank())
            .field("layout", &self.layout)
            .finish()
    }
}

impl RankExecutor {
    /// Cuts rank `comm.rank()` of `opts.tp` out of `store`, allocates its KV cache through
    /// `alloc` and starts its thread.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`], weight errors, memory errors, thread spawn errors.
    pub fn spawn(
        config: &ModelConfig,
        store: &TensorStore,
        comm: ThreadCollective,
        opts: &TpOptions,
        alloc: &dyn HostMemoryAllocator,
    ) -> Result<Self> {
        let rank = comm.rank();
        let shard = ModelShard::load(config, store, rank, opts.tp, opts.format)?;
        let layout = opts.rank_layout(config);
        let kv = KvCache::new(layout, alloc)?;
        let rank_comm = comm.clone();
        let thread = RankThread::spawn(format!("pdserve-tp{rank}"), RANK_QUEUE, comm, move |rx| {
            rank_loop(shard, kv, rank_comm, rx)
        })?;
        Ok(Self { thread, layout })
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.thread.rank()
    }

    /// This rank's KV layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Queues a forward step; `done` gets the result on the rank thread.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone (then `done`
    /// is not called).
    pub fn submit(
        &self,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        done: StepCallback,
    ) -> Result<()> {
        self.submit_fed(batch, hook, None, done)
    }

    /// As [`RankExecutor::submit`], with `feed` called at every layer before attention reads
    /// it ([`KvFeed`]).
    ///
    /// # Errors
    /// As [`RankExecutor::submit`].
    pub fn submit_fed(
        &self,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        feed: Option<KvFeed>,
        done: StepCallback,
    ) -> Result<()> {
        self.thread.send(Job::Forward {
            batch,
            hook,
            feed,
            done,
        })
    }

    /// Queues `job` on this rank's KV cache without waiting: it runs on the rank thread after
    /// every job queued before it and before every job queued after it (KV tier spills and
    /// restores, ordered against the steps that write the same blocks).
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone (the job is
    /// dropped unrun).
    pub fn submit_kv(&self, job: KvJob) -> Result<()> {
        self.thread.send(Job::WithKv { job })
    }

    /// Runs `f` on this rank's KV cache, on the rank thread, between steps, and waits for it.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the thread is gone.
    pub fn with_kv<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KvCache) -> T + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = sync_channel(1);
        let job: KvJob = Box::new(move |kv| {
            let _ = tx.send(f(kv));
        });
        self.thread.send(Job::WithKv { job })?;
        rx.recv()
            .map_err(|_| self.thread.gone("rank thread is gone"))
    }

    /// Fails every collective this group is waiting in (a peer rank died).
    pub fn poison(&self, reason: &str) {
        self.thread.poison(reason);
    }

    /// Clears a poisoned collective once no rank is inside a step.
    pub fn reset(&self) {
        self.thread.reset();
    }
}

/// A model split over `tp` [`RankExecutor`]s, stepped together.
pub struct TpGroup {
    ranks: Vec<RankExecutor>,
    config: ModelConfig,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("tp", &self.ranks.len())
            .finish()
    }
}

impl TpGroup {
    /// Cuts the shards, allocates each rank's KV cache through `alloc`, and starts the rank
    /// threads.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`], weight errors, or memory errors from the allocator.
    pub fn new(
        config: &ModelConfig,
        store: &TensorStore,
        opts: &TpOptions,
        alloc: &dyn HostMemoryAllocator,
    ) -> Result<Self> {
        config.check_tp(opts.tp)?;
        let ranks = ThreadCollective::group(opts.tp, COLLECTIVE_TIMEOUT)
            .into_iter()
            .map(|comm| RankExecutor::spawn(config, store, comm, opts, alloc))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            ranks,
            config: config.clone(),
        })
    }

    /// Number of ranks.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Each rank's KV layout.
    pub fn layouts(&self) -> Vec<KvLayout> {
        self.ranks.iter().map(|r| r.layout).collect()
    }

    /// Runs one forward step on every rank and returns the logits (one vector per sequence
    /// that asked for them).
    ///
    /// # Errors
    /// Invalid batches, or [`ModelError::RankFailed`] when a rank failed or died.
    pub fn step(&self, batch: Batch) -> Result<Vec<Vec<f32>>> {
        self.step_with_hook(batch, None)
    }

    /// As [`TpGroup::step`], calling `hook(rank, layer)` as each layer's K/V are written.
    ///
    /// # Errors
    /// As [`TpGroup::step`].
    pub fn step_with_hook(&self, batch: Batch, hook: Option<LayerHook>) -> Result<Vec<Vec<f32>>> {
        step_ranks(&self.ranks, batch, hook)
    }

    /// Runs `f` on rank `rank`'s KV cache, on that rank's thread, between steps.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the rank thread is gone.
    pub fn with_kv<T: Send + 'static>(
        &self,
        rank: usize,
        f: impl FnOnce(&mut KvCache) -> T + Send + 'static,
    ) -> Result<T> {
        self.ranks[rank].with_kv(f)
    }
}

/// What [`step_ranks`] needs of one rank's executor (the CPU [`RankExecutor`] or a device
/// backend's).
pub(crate) trait StepRank {
    fn submit(&self, batch: Arc<Batch>, hook: Option<LayerHook>, done: StepCallback) -> Result<()>;
    fn poison(&self, reason: &str);
    fn reset(&self);
}

impl StepRank for RankExecutor {
    fn submit(&self, batch: Arc<Batch>, hook: Option<LayerHook>, done: StepCallback) -> Result<()> {
        RankExecutor::submit(self, batch, hook, done)
    }
    fn poison(&self, reason: &str) {
        RankExecutor::poison(self, reason)
    }
    fn reset(&self) {
        RankExecutor::reset(self)
    }
}

/// Runs one step on every rank and returns rank 0's logits. A rank that cannot take the job
/// poisons the group so the others leave their collectives; the group is reset once every
/// rank answered.
pub(crate) fn step_ranks<R: StepRank>(
    ranks: &[R],
    batch: Batch,
    hook: Option<LayerHook>,
) -> Result<Vec<Vec<f32>>> {
    let batch = Arc::new(batch);
    let mut replies: Vec<Receiver<Result<Vec<Vec<f32>>>>> = Vec::new();
    for rank in ranks {
        let (tx, rx) = sync_channel(1);
        let done: StepCallback = Box::new(move |r| {
            let _ = tx.send(r);
        });
        if let Err(e) = rank.submit(batch.clone(), hook.clone(), done) {
            rank.poison(&e.to_string());
            // Drain the ranks already started so none is left inside a collective.
            for rx in replies {
                let _ = rx.recv();
            }
            rank.reset();
            return Err(e);
        }
        replies.push(rx);
    }
    let mut first_err = None;
    let mut logits = Vec::new();
    for (r, rx) in replies.into_iter().enumerate() {
        match rx.recv() {
            Ok(Ok(l)) if r == 0 => logits = l,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(ModelError::RankFailed {
                    rank: r,
                    reason: "rank thread exited".into(),
                });
            }
        }
    }
    if let Some(e) = first_err {
        // Every rank has answered: nobody is inside a collective, so it can be cleared.
        ranks[0].reset();
        return Err(e);
    }
    Ok(logits)
}

fn rank_loop(shard: ModelShard, mut kv: KvCache, comm: ThreadCollective, jobs: Receiver<Job>) {
    let rank = comm.rank();
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Forward {
                batch,
                hook,
                feed,
                done,
            } => {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut on_layer = |l: usize, kv: &mut KvCache| {
                        if let Some(f) = &feed {
                            f(rank, l, kv);
                        }
                        if let Some(h) = &hook {
                            h(rank, l);
                        }
                    };
                    shard.forward(&batch, &mut kv, &comm, &mut on_layer)
                }));
                let result = match result {
                    Ok(r) => r,
                    Err(panic) => {
                        let msg = panic_message(&panic);
                        tracing::error!(rank, %msg, "forward pass panicked");
                        Err(ModelError::RankFailed {
                            rank,
                            reason: format!("panicked: {msg}"),
                        })
                    }
                };
                if let Err(e) = &result {
                    comm.poison(&e.to_string());
                }
                done(result);
            }
            Job::WithKv { job } => job(&mut kv),
        }
    }
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// `join` returns only after the thread's shutdown ran (what a command-line run needs
    /// before it exits); dropping does not wait for it.
    #[test]
    fn join_waits_for_the_threads_shutdown_and_drop_does_not() {
        for joined in [true, false] {
            let comm = ThreadCollective::group(1, Duration::from_secs(5)).remove(0);
            let (started, done) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let (s, d) = (started.clone(), done.clone());
            let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
            let t = RankThread::spawn("test-rank".into(), 4, comm, move |rx: Receiver<u32>| {
                while rx.recv().is_ok() {}
                s.store(true, Ordering::SeqCst);
                // Shutdown work that outlasts the queue's closing.
                let _ = release_rx.recv_timeout(Duration::from_secs(5));
                d.store(true, Ordering::SeqCst);
            })
            .unwrap();
            t.send(1).unwrap();
            if joined {
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    let _ = release_tx.send(());
                });
                t.join();
                assert!(
                    done.load(Ordering::SeqCst),
                    "join returned before the shutdown"
                );
            } else {
                drop(t);
                while !started.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(!done.load(Ordering::SeqCst), "drop waited");
                let _ = release_tx.send(());
            }
        }
    }
}
