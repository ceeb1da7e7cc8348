//! Tensor parallelism on CPU: one named OS thread per rank, each owning its model shard and
//! its KV cache, fed through bounded channels.
//!
//! [`TpGroup::step`] hands the same [`Batch`] to every rank and returns rank 0's logits. A rank
//! that fails or panics poisons the group's collective, so the others stop waiting at once;
//! the step fails with [`ModelError::RankFailed`] and the group is usable again afterwards.

use crate::collective::{Collective, ThreadCollective};
use crate::config::ModelConfig;
use crate::kv::{KvCache, KvLayout};
use crate::model::{Batch, ModelShard};
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

type KvJob = Box<dyn FnOnce(&mut KvCache) + Send>;

enum Job {
    Forward { batch: Arc<Batch>, hook: Option<LayerHook>, reply: SyncSender<Result<Vec<Vec<f32>>>> },
    WithKv { job: KvJob },
}

struct Rank {
    jobs: SyncSender<Job>,
    thread: Option<JoinHandle<()>>,
    layout: KvLayout,
    comm: ThreadCollective,
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
}

/// A model split over `tp` rank threads.
pub struct TpGroup {
    ranks: Vec<Rank>,
    config: ModelConfig,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup").field("tp", &self.ranks.len()).finish()
    }
}

impl TpGroup {
    /// Cuts the shards, allocates each rank's KV cache through `alloc`, and starts the rank
    /// threads (`pdserve-tp{rank}`).
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
        let comms = ThreadCollective::group(opts.tp, COLLECTIVE_TIMEOUT);
        let mut ranks = Vec::with_capacity(opts.tp);
        for (r, comm) in comms.into_iter().enumerate() {
            let shard = ModelShard::load(config, store, r, opts.tp, opts.format)?;
            let layout = KvLayout {
                num_layers: config.num_layers,
                num_blocks: opts.num_blocks,
                block_size: opts.block_size,
                num_kv_heads: config.num_kv_heads / opts.tp,
                head_dim: config.head_dim,
                dtype: crate::kv::KvDtype::F32,
            };
            let kv = KvCache::new(layout, alloc)?;
            let (tx, rx) = sync_channel::<Job>(2);
            let rank_comm = comm.clone();
            let thread = std::thread::Builder::new()
                .name(format!("pdserve-tp{r}"))
                .spawn(move || rank_loop(shard, kv, rank_comm, rx))?;
            ranks.push(Rank { jobs: tx, thread: Some(thread), layout, comm });
        }
        Ok(Self { ranks, config: config.clone() })
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
        let batch = Arc::new(batch);
        let mut replies: Vec<Receiver<Result<Vec<Vec<f32>>>>> = Vec::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            let (tx, rx) = sync_channel(1);
            let job = Job::Forward { batch: batch.clone(), hook: hook.clone(), reply: tx };
            if rank.jobs.send(job).is_err() {
                self.ranks.iter().for_each(|r| r.comm.poison("a rank thread is gone"));
                return Err(ModelError::RankFailed { rank: r, reason: "rank thread is gone".into() });
            }
            replies.push(rx);
        }
        let mut first_err = None;
        let mut logits = Vec::new();
        for (r, rx) in replies.into_iter().enumerate() {
            match rx.recv() {
                Ok(Ok(l)) => {
                    if r == 0 {
                        logits = l;
                    }
                }
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
            self.ranks[0].comm.reset();
            return Err(e);
        }
        Ok(logits)
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
        let (tx, rx) = sync_channel(1);
        let job: KvJob = Box::new(move |kv| {
            let _ = tx.send(f(kv));
        });
        let gone = || ModelError::RankFailed { rank, reason: "rank thread is gone".into() };
        self.ranks[rank].jobs.send(Job::WithKv { job }).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }
}

impl Drop for TpGroup {
    fn drop(&mut self) {
        for rank in &mut self.ranks {
            // Closing the channel ends the loop.
            let (dead, _) = sync_channel(1);
            rank.jobs = dead;
            if let Some(t) = rank.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn rank_loop(shard: ModelShard, mut kv: KvCache, comm: ThreadCollective, jobs: Receiver<Job>) {
    let rank = comm.rank();
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Forward { batch, hook, reply } => {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut on_layer = |l: usize| {
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
                        Err(ModelError::RankFailed { rank, reason: format!("panicked: {msg}") })
                    }
                };
                if let Err(e) = &result {
                    comm.poison(&e.to_string());
                }
                let _ = reply.send(result);
            }
            Job::WithKv { job } => job(&mut kv),
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
