//! A CPU stand-in for the CUDA rank executor, for tests on machines without a GPU.
//!
//! It runs the CPU model shard, but keeps the CUDA executor's memory contract
//! (`pdserve_gpu::cuda::CudaRankExecutor`, docs/cuda.md "KV cache on the device"):
//!
//! - its KV cache is **private** (the "device"): anonymous memory that the transfer engine
//!   never sees;
//! - with a mirror, it allocates one host region per layer through the rank's allocator (the
//!   transfer engine's, which registers them): that mirror is what the KV handshake
//!   describes and what transfers read from or land in;
//! - [`KvMirror::WriteThrough`]: after each layer's K/V write, the blocks the step touched
//!   are copied device → mirror, and only then the layer hook fires;
//! - [`KvMirror::Receive`]: transfers land in the mirror; nothing reaches the private cache
//!   until [`StandInExecutor::upload_kv`] copies the blocks mirror → device.
//!
//! So a decode side that forgot to upload decodes from stale (zeroed) KV and its tokens
//! differ: the tests that use it can fail. [`StandInFaults`] injects a failed upload, a lost
//! device (every later step fails with a device runtime error, as a CUDA context does after a
//! sticky error) and skipped uploads.

use super::mirror::KvMirror;
use pdserve_gpu::batch::Batch;
use pdserve_gpu::collective::{Collective, ThreadCollective};
use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::device::DeviceError;
use pdserve_gpu::kv::{KvCache, KvKind, KvLayout};
use pdserve_gpu::model::ModelShard;
use pdserve_gpu::tp::{LayerHook, RankThread, StepCallback, TpOptions, UploadCallback};
use pdserve_gpu::weights::TensorStore;
use pdserve_gpu::ModelError;
use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Test-only faults of the stand-in executors of one instance (shared by its ranks and by
/// their restarted incarnations).
#[derive(Debug, Default)]
pub struct StandInFaults {
    fail_uploads: AtomicUsize,
    lose_device: AtomicBool,
    skip_uploads: AtomicBool,
    uploads: AtomicU64,
    spawned: AtomicU64,
}

impl StandInFaults {
    /// No fault armed.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The next `n` uploads (over all ranks) fail with a device error.
    pub fn fail_next_uploads(&self, n: usize) {
        self.fail_uploads.store(n, Ordering::SeqCst);
    }

    /// The next step of any rank finds its device lost: that step and every later one of
    /// that executor fail. A restarted rank gets a fresh, working device.
    pub fn lose_device(&self) {
        self.lose_device.store(true, Ordering::SeqCst);
    }

    /// Uploads report success without copying anything (a decode side that "forgot" to
    /// upload: proves that a test comparing tokens would notice).
    pub fn skip_uploads(&self, on: bool) {
        self.skip_uploads.store(on, Ordering::SeqCst);
    }

    /// Uploads completed (copied) so far, over all ranks.
    pub fn uploads_done(&self) -> u64 {
        self.uploads.load(Ordering::SeqCst)
    }

    /// Executors started so far (ranks and their restarts).
    pub fn executors_started(&self) -> u64 {
        self.spawned.load(Ordering::SeqCst)
    }

    fn take_upload_failure(&self) -> bool {
        self.fail_uploads
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

enum Job {
    Forward {
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        done: StepCallback,
    },
    Upload {
        blocks: Vec<u32>,
        done: UploadCallback,
    },
}

/// Jobs queued beyond the one running (as the CUDA executor's).
const QUEUE: usize = 4;

/// One rank of the stand-in: a named thread (`pdserve-standin{rank}`) owning the CPU shard,
/// the private cache and (with a mirror) the host mirror.
pub struct StandInExecutor {
    thread: RankThread<Job>,
    mirror: KvMirror,
}

impl std::fmt::Debug for StandInExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandInExecutor")
            .field("rank", &self.thread.rank())
            .field("mirror", &self.mirror)
            .finish()
    }
}

impl StandInExecutor {
    /// Cuts rank `comm.rank()`'s shard, allocates the private cache (anonymous memory) and,
    /// unless `mirror` is off, the mirror through `alloc`, and starts the thread.
    ///
    /// # Errors
    /// Weight errors, memory errors, thread spawn errors.
    pub fn spawn(
        config: &ModelConfig,
        store: &TensorStore,
        comm: ThreadCollective,
        opts: &TpOptions,
        mirror: KvMirror,
        faults: Arc<StandInFaults>,
        alloc: &dyn HostMemoryAllocator,
    ) -> Result<Self, ModelError> {
        let rank = comm.rank();
        let shard = ModelShard::load(config, store, rank, opts.tp, opts.format)?;
        let layout = opts.rank_layout(config);
        let device = KvCache::new(layout, &AnonAllocator)?;
        let host = match mirror {
            KvMirror::Off => None,
            _ => Some(KvCache::new(layout, alloc)?),
        };
        faults.spawned.fetch_add(1, Ordering::SeqCst);
        let state = RankState {
            shard,
            device,
            host,
            mirror,
            faults,
            comm: comm.clone(),
            lost: false,
        };
        let thread = RankThread::spawn(format!("pdserve-standin{rank}"), QUEUE, comm, move |rx| {
            state.run(rx)
        })?;
        Ok(Self { thread, mirror })
    }

    /// Queues a forward step (as the CUDA executor's `submit`).
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone.
    pub fn submit(
        &self,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        done: StepCallback,
    ) -> Result<(), ModelError> {
        self.thread.send(Job::Forward { batch, hook, done })
    }

    /// Queues the copy of `blocks` (every layer) from the mirror into the private cache;
    /// steps queued later see them. `done` runs once it ended.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone.
    pub fn upload_kv(&self, blocks: Vec<u32>, done: UploadCallback) -> Result<(), ModelError> {
        self.thread.send(Job::Upload { blocks, done })
    }

    /// Fails every collective the group waits in.
    pub fn poison(&self, reason: &str) {
        self.thread.poison(reason);
    }
}

/// What the stand-in's rank thread owns (dropping the executor closes its queue, which ends
/// the thread once its job in hand is done; it is never joined).
struct RankState {
    shard: ModelShard,
    device: KvCache,
    host: Option<KvCache>,
    mirror: KvMirror,
    faults: Arc<StandInFaults>,
    comm: ThreadCollective,
    lost: bool,
}

fn lost_error() -> ModelError {
    DeviceError::Runtime {
        op: "stand-in step".into(),
        reason: "the device was lost (injected)".into(),
    }
    .into()
}

impl RankState {
    fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            match job {
                Job::Forward { batch, hook, done } => {
                    let r = self.forward(&batch, hook.as_ref());
                    if let Err(e) = &r {
                        self.comm.poison(&e.to_string());
                    }
                    done(r);
                }
                Job::Upload { blocks, done } => done(self.upload(&blocks)),
            }
        }
    }

    fn forward(
        &mut self,
        batch: &Batch,
        hook: Option<&LayerHook>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if self.faults.lose_device.swap(false, Ordering::SeqCst) {
            self.lost = true;
        }
        if self.lost {
            return Err(lost_error());
        }
        let rank = self.comm.rank();
        let layout = *self.device.layout();
        let touched = touched_blocks(batch, layout.block_size, layout.num_blocks);
        let device: Vec<Arc<dyn HostMemory>> = self.device.regions().to_vec();
        let mirror: Option<Vec<Arc<dyn HostMemory>>> = (self.mirror == KvMirror::WriteThrough)
            .then(|| self.host.as_ref().map(|h| h.regions().to_vec()))
            .flatten();
        let mut on_layer = |layer: usize, _: &mut pdserve_gpu::kv::KvCache| {
            if let Some(mirror) = &mirror {
                // The layer's K/V are written: copy the touched blocks to the mirror first,
                // then report the layer (a peer never reads bytes not yet copied).
                copy_blocks(&layout, &device, mirror, layer..layer + 1, &touched);
            }
            if let Some(h) = hook {
                h(rank, layer);
            }
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.shard
                .forward(batch, &mut self.device, &self.comm, &mut on_layer)
        }));
        r.unwrap_or_else(|_| {
            Err(ModelError::RankFailed {
                rank,
                reason: "stand-in forward pass panicked".into(),
            })
        })
    }

    fn upload(&mut self, blocks: &[u32]) -> Result<(), ModelError> {
        let layout = *self.device.layout();
        if self.lost {
            return Err(lost_error());
        }
        if self.faults.take_upload_failure() {
            return Err(DeviceError::Runtime {
                op: "copy KV from host mirror".into(),
                reason: "injected upload failure".into(),
            }
            .into());
        }
        let Some(host) = &self.host else {
            return Err(DeviceError::Unsupported("a KV upload needs a host mirror".into()).into());
        };
        if let Some(b) = blocks.iter().find(|&&b| b as usize >= layout.num_blocks) {
            return Err(DeviceError::Unsupported(format!("block id {b} out of range")).into());
        }
        if self.faults.skip_uploads.load(Ordering::SeqCst) {
            return Ok(());
        }
        let host = host.regions().to_vec();
        copy_blocks(
            &layout,
            &host,
            self.device.regions(),
            0..layout.num_layers,
            blocks,
        );
        self.faults.uploads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The distinct blocks a step writes K/V into (in range of the pool), sorted.
fn touched_blocks(batch: &Batch, block_size: usize, num_blocks: usize) -> Vec<u32> {
    let mut b: Vec<u32> = batch
        .seqs
        .iter()
        .flat_map(|s| {
            (s.start_pos..s.start_pos + s.tokens.len())
                .filter_map(|p| s.block_table.get(p / block_size).copied())
        })
        .filter(|&b| (b as usize) < num_blocks)
        .collect();
    b.sort_unstable();
    b.dedup();
    b
}

/// Copies `blocks` (K and V, every head) of `layers` from `from` to `to`, regions laid out
/// as `layout`.
fn copy_blocks(
    layout: &KvLayout,
    from: &[Arc<dyn HostMemory>],
    to: &[Arc<dyn HostMemory>],
    layers: std::ops::Range<usize>,
    blocks: &[u32],
) {
    for layer in layers {
        for kind in [KvKind::Key, KvKind::Value] {
            for &b in blocks {
                let span = layout.span(layer, kind, b as usize, 0..layout.num_kv_heads);
                let (src, dst) = (&from[span.region], &to[span.region]);
                assert!(span.offset + span.len <= src.len().min(dst.len()));
                // SAFETY: the span lies inside both regions (asserted), which are distinct
                // mappings that live as long as the Arcs held here; the rank thread is the
                // only writer of its private cache, and the scheduler's block ownership keeps
                // peers off mirror blocks while they are copied.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr().add(span.offset),
                        dst.as_ptr().add(span.offset),
                        span.len,
                    );
                }
            }
        }
    }
}
