//! Tensor-parallel ranks on GPUs: one named OS thread per rank (`pdserve-cuda{rank}`) owning
//! the rank's GPU context, stream, weights and device KV cache, fed through a bounded channel,
//! answering through callbacks: the same contract as the CPU [`crate::tp::RankExecutor`], so
//! an actor hands a step over and never waits on the device.
//!
//! Beside each rank thread a fence thread (`pdserve-cuda{rank}-fence`) waits on CUDA events in
//! stream order and only then runs what depended on them: the layer hook of a step (a layer
//! is reported ready once the event recorded after its K/V write and its device → mirror copy
//! completed) and the completion of a KV upload. The rank thread keeps queueing kernels
//! meanwhile, so layerwise KV push overlaps the remaining layers.
//!
//! All-reduce between ranks goes through host memory ([`ThreadCollective`]); NCCL is future
//! work.

use super::context::{GemmDtype, GpuContext};
use super::fence::{Completion, FenceItem};
use super::kv::{DeviceKvCache, IpcRegionHandle, MirrorMode, PeerDeviceKv};
use super::model::CudaShard;
use super::nvrtc::KernelCache;
use crate::batch::Batch;
use crate::collective::{Collective, ThreadCollective};
use crate::config::ModelConfig;
use crate::device::DeviceError;
use crate::engine::StepGroup;
use crate::kv::{KvLayout, KvSpan};
use crate::tp::{
    panic_message, step_ranks, LayerHook, RankThread, StepCallback, StepRank, TpOptions,
    COLLECTIVE_TIMEOUT,
};
use crate::weights::TensorStore;
use crate::{ModelError, Result};
use cudarc::driver::CudaEvent;
use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Arc;

/// Jobs a rank may have queued beyond the one it runs.
const RANK_QUEUE: usize = 4;

/// How to run a model on CUDA.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// GPU of rank 0; rank `r` uses GPU `first_gpu + r`.
    pub first_gpu: usize,
    /// Matmul weight type.
    pub dtype: GemmDtype,
    /// Host mirror of the KV cache (prefill: write-through; decode: receive).
    pub mirror: MirrorMode,
}

// `upload_kv`'s callback runs on the fence thread once the upload completed on the device.
pub use crate::tp::UploadCallback;

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
    ReadSpan {
        span: KvSpan,
        reply: SyncSender<Result<Vec<u8>>>,
    },
    ExportIpc {
        reply: SyncSender<Result<Vec<IpcRegionHandle>>>,
    },
    CopyFromPeer {
        layout: KvLayout,
        handles: Vec<IpcRegionHandle>,
        pairs: Vec<(u32, u32)>,
        reply: SyncSender<Result<()>>,
    },
}

/// The fence thread's items: continuations after CUDA events (see [`super::fence`]).
type Fence = FenceItem<CudaEvent>;

impl Completion for CudaEvent {
    fn wait(&self) -> Result<()> {
        self.synchronize()
            .map_err(super::context::rt("wait for event"))
            .map_err(ModelError::from)
    }
}

/// One tensor-parallel rank on a GPU.
pub struct CudaRankExecutor {
    thread: RankThread<Job>,
    layout: KvLayout,
    mirror: Vec<Arc<dyn HostMemory>>,
    arch: String,
    ordinal: usize,
    gpu_uuid: [u8; 16],
}

impl std::fmt::Debug for CudaRankExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRankExecutor")
            .field("rank", &self.thread.rank())
            .field("arch", &self.arch)
            .field("layout", &self.layout)
            .finish()
    }
}

impl CudaRankExecutor {
    /// Opens GPU `cuda.first_gpu + rank`, uploads rank `comm.rank()` of `opts.tp`, allocates its
    /// device KV cache (and, with a mirror, its host regions through `alloc`, which the
    /// transfer engine registers) and starts the rank and fence threads.
    ///
    /// # Errors
    /// The probe's errors when there is no usable driver or GPU, kernel compilation errors,
    /// weight errors, out of device memory, [`ModelError::BadTpSize`].
    pub fn spawn(
        config: &ModelConfig,
        store: &TensorStore,
        comm: ThreadCollective,
        opts: &TpOptions,
        cuda: &CudaOptions,
        alloc: Option<&dyn HostMemoryAllocator>,
    ) -> Result<Self> {
        let rank = comm.rank();
        let gpu = Arc::new(GpuContext::new(
            cuda.first_gpu + rank,
            &KernelCache::from_env(),
        )?);
        let gpu_uuid = gpu
            .context()
            .uuid()
            .map(|u| u.bytes.map(|b| b as u8))
            .map_err(super::context::rt("cuDeviceGetUuid"))?;
        let shard = CudaShard::load(gpu.clone(), config, store, rank, opts.tp, cuda.dtype)?;
        let layout = opts.rank_layout(config);
        let mirror = match (cuda.mirror, alloc) {
            (MirrorMode::Off, _) => None,
            (_, None) => {
                return Err(DeviceError::Unsupported(
                    "a KV host mirror needs the transfer engine's allocator".into(),
                )
                .into())
            }
            (mode, Some(alloc)) => Some((
                mode,
                (0..layout.num_layers)
                    .map(|_| alloc.allocate(layout.region_bytes()))
                    .collect::<std::io::Result<Vec<_>>>()?,
            )),
        };
        let mirror_regions = mirror.as_ref().map(|m| m.1.clone()).unwrap_or_default();
        let kv = DeviceKvCache::new(gpu.clone(), layout, mirror)?;
        let (fence_tx, fence_rx) = channel::<Fence>();
        let fence_thread = std::thread::Builder::new()
            .name(format!("pdserve-cuda{rank}-fence"))
            .spawn(move || super::fence::run(fence_rx))?;
        let rank_comm = comm.clone();
        let arch = gpu.arch().to_string();
        let thread =
            RankThread::spawn(format!("pdserve-cuda{rank}"), RANK_QUEUE, comm, move |rx| {
                rank_loop(shard, kv, rank_comm, rx, (fence_tx, fence_thread))
            })?;
        Ok(Self {
            thread,
            layout,
            mirror: mirror_regions,
            arch,
            ordinal: cuda.first_gpu + rank,
            gpu_uuid,
        })
    }

    /// Stops the rank and waits until its thread freed the KV cache and the context.
    pub fn join(self) {
        self.thread.join();
    }

    /// The GPU's ordinal in this process.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's UUID (`cuDeviceGetUuid`): two processes on the same GPU see the same one.
    pub fn gpu_uuid(&self) -> [u8; 16] {
        self.gpu_uuid
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.thread.rank()
    }

    /// This rank's KV layout (the CPU backend's, byte for byte).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The KV host mirror's regions, one per layer (empty without a mirror): what the transfer
    /// engine registered through the allocator given to [`CudaRankExecutor::spawn`].
    pub fn mirror_regions(&self) -> &[Arc<dyn HostMemory>] {
        &self.mirror
    }

    /// Queues a forward step; `done` gets the result on the rank thread. `hook(rank, layer)`
    /// runs on the fence thread once the layer's K/V are on the device and, with a
    /// write-through mirror, in the mirror.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone.
    pub fn submit(
        &self,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        done: StepCallback,
    ) -> Result<()> {
        self.thread.send(Job::Forward { batch, hook, done })
    }

    /// Queues the copy of `blocks` (all layers) from the mirror to the device, after a
    /// transfer landed them there; steps queued later see them. `done` runs once the copy
    /// completed on the device.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the queue is full or the thread is gone.
    pub fn upload_kv(&self, blocks: Vec<u32>, done: UploadCallback) -> Result<()> {
        self.thread.send(Job::Upload { blocks, done })
    }

    /// Reads a span of this rank's device KV (between steps; tests and tools).
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the thread is gone; device errors.
    pub fn read_kv_span(&self, span: KvSpan) -> Result<Vec<u8>> {
        let (tx, rx) = sync_channel(1);
        self.thread.send(Job::ReadSpan { span, reply: tx })?;
        rx.recv()
            .map_err(|_| self.thread.gone("rank thread is gone"))?
    }

    /// CUDA IPC handles of this rank's device KV regions (for a process on the same GPU).
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the thread is gone; device errors.
    pub fn export_ipc(&self) -> Result<Vec<IpcRegionHandle>> {
        let (tx, rx) = sync_channel(1);
        self.thread.send(Job::ExportIpc { reply: tx })?;
        rx.recv()
            .map_err(|_| self.thread.gone("rank thread is gone"))?
    }

    /// Copies `pairs` of `(peer block, own block)` from a peer process's device KV on the same
    /// GPU (opened from its IPC `handles`; `layout` is the peer's) and waits until the copy
    /// completed.
    ///
    /// # Errors
    /// [`ModelError::RankFailed`] when the thread is gone; a layout mismatch; device errors.
    pub fn copy_from_peer(
        &self,
        layout: KvLayout,
        handles: Vec<IpcRegionHandle>,
        pairs: Vec<(u32, u32)>,
    ) -> Result<()> {
        let (tx, rx) = sync_channel(1);
        self.thread.send(Job::CopyFromPeer {
            layout,
            handles,
            pairs,
            reply: tx,
        })?;
        rx.recv()
            .map_err(|_| self.thread.gone("rank thread is gone"))?
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

impl StepRank for CudaRankExecutor {
    fn submit(&self, batch: Arc<Batch>, hook: Option<LayerHook>, done: StepCallback) -> Result<()> {
        CudaRankExecutor::submit(self, batch, hook, done)
    }
    fn poison(&self, reason: &str) {
        CudaRankExecutor::poison(self, reason)
    }
    fn reset(&self) {
        CudaRankExecutor::reset(self)
    }
}

fn rank_loop(
    shard: CudaShard,
    kv: DeviceKvCache,
    comm: ThreadCollective,
    jobs: Receiver<Job>,
    (fence, fence_thread): (Sender<Fence>, std::thread::JoinHandle<()>),
) {
    let rank = comm.rank();
    if let Err(e) = shard.gpu().context().bind_to_thread() {
        tracing::error!(rank, error = ?e, "cannot bind the CUDA context to the rank thread");
        return;
    }
    let write_through = kv
        .mirror()
        .is_some_and(|m| m.mode() == MirrorMode::WriteThrough);
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Forward { batch, hook, done } => {
                let mut fenced = false;
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut on_layer = |layer: usize, plan: &super::plan::StepPlan| -> Result<()> {
                        if write_through {
                            let blocks = plan.touched_blocks(kv.layout().block_size);
                            kv.copy_to_mirror(layer, &blocks)?;
                        }
                        if let Some(h) = &hook {
                            let event = shard
                                .gpu()
                                .stream()
                                .record_event(None)
                                .map_err(super::context::rt("record layer event"))?;
                            let h = h.clone();
                            fenced = true;
                            let _ = fence.send(Fence::After {
                                point: event,
                                then: Box::new(move |r| {
                                    if r.is_ok() {
                                        h(rank, layer)
                                    }
                                }),
                            });
                        }
                        Ok(())
                    };
                    shard.forward(&batch, &kv, &comm, &mut on_layer)
                }));
                let mut result = match result {
                    Ok(r) => r,
                    Err(panic) => {
                        let msg = panic_message(&panic);
                        tracing::error!(rank, %msg, "CUDA forward pass panicked");
                        Err(ModelError::RankFailed {
                            rank,
                            reason: format!("panicked: {msg}"),
                        })
                    }
                };
                if write_through && result.is_ok() {
                    // Without a hook, the step's mirror copies still complete before `done`.
                    result = shard.gpu().synchronize().map_err(Into::into).and(result);
                }
                if fenced {
                    // Every layer hook ran before the step is reported done.
                    let (tx, rx) = sync_channel(1);
                    if fence.send(Fence::Barrier(tx)).is_ok() {
                        let _ = rx.recv();
                    }
                }
                if let Err(e) = &result {
                    comm.poison(&e.to_string());
                }
                done(result);
            }
            Job::Upload { blocks, done } => {
                let queued = kv.upload_blocks(&blocks).and_then(|()| {
                    shard
                        .gpu()
                        .stream()
                        .record_event(None)
                        .map_err(super::context::rt("record upload event"))
                });
                match queued {
                    Ok(event) => {
                        let _ = fence.send(Fence::After {
                            point: event,
                            then: Box::new(done),
                        });
                    }
                    Err(e) => done(Err(e.into())),
                }
            }
            Job::ReadSpan { span, reply } => {
                let _ = reply.send(kv.read_span(span).map_err(Into::into));
            }
            Job::ExportIpc { reply } => {
                let _ = reply.send(kv.ipc_handles().map_err(Into::into));
            }
            Job::CopyFromPeer {
                layout,
                handles,
                pairs,
                reply,
            } => {
                let r =
                    PeerDeviceKv::open(shard.gpu().clone(), layout, &handles).and_then(|peer| {
                        kv.copy_from_peer(&peer, &pairs)?;
                        // The peer's mapping is closed when `peer` drops: finish the copy first.
                        shard.gpu().synchronize()
                    });
                let _ = reply.send(r.map_err(Into::into));
            }
        }
    }
    // Shut down in order: the fence thread's pending events and continuations finish before
    // the KV cache (device regions, pinned mirror) and the context go away.
    drop(fence);
    if fence_thread.join().is_err() {
        tracing::error!(rank, "the CUDA fence thread panicked");
    }
    drop(kv);
    drop(shard);
}

/// A model split over `tp` GPUs ([`CudaRankExecutor`]s), stepped together.
pub struct CudaTpGroup {
    ranks: Vec<CudaRankExecutor>,
    config: ModelConfig,
}

impl std::fmt::Debug for CudaTpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTpGroup")
            .field("ranks", &self.ranks)
            .finish()
    }
}

impl CudaTpGroup {
    /// Stops every rank and waits until each freed its device state (a command-line run does
    /// this before it exits; dropping the group does not wait).
    pub fn join(self) {
        for r in self.ranks {
            r.join();
        }
    }

    /// Starts `opts.tp` ranks on GPUs `cuda.first_gpu..`.
    ///
    /// # Errors
    /// As [`CudaRankExecutor::spawn`].
    pub fn new(
        config: &ModelConfig,
        store: &TensorStore,
        opts: &TpOptions,
        cuda: &CudaOptions,
        alloc: Option<&dyn HostMemoryAllocator>,
    ) -> Result<Self> {
        config.check_tp(opts.tp)?;
        crate::device::probe_cuda(cuda.first_gpu + opts.tp)?;
        let ranks = ThreadCollective::group(opts.tp, COLLECTIVE_TIMEOUT)
            .into_iter()
            .map(|comm| CudaRankExecutor::spawn(config, store, comm, opts, cuda, alloc))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            ranks,
            config: config.clone(),
        })
    }

    /// The ranks.
    pub fn ranks(&self) -> &[CudaRankExecutor] {
        &self.ranks
    }

    /// Each rank's KV layout.
    pub fn layouts(&self) -> Vec<KvLayout> {
        self.ranks.iter().map(|r| r.layout).collect()
    }

    /// Runs one step on every rank, as [`crate::tp::TpGroup::step_with_hook`].
    ///
    /// # Errors
    /// Invalid batches, device failures, [`ModelError::RankFailed`].
    pub fn step_with_hook(&self, batch: Batch, hook: Option<LayerHook>) -> Result<Vec<Vec<f32>>> {
        step_ranks(&self.ranks, batch, hook)
    }

    /// Copies `blocks` from every rank's mirror to its device and waits until it completed.
    ///
    /// # Errors
    /// Device failures; [`ModelError::RankFailed`].
    pub fn upload_kv(&self, blocks: &[u32]) -> Result<()> {
        let mut waits = Vec::new();
        for r in &self.ranks {
            let (tx, rx) = sync_channel(1);
            r.upload_kv(
                blocks.to_vec(),
                Box::new(move |res| {
                    let _ = tx.send(res);
                }),
            )?;
            waits.push(rx);
        }
        for (i, rx) in waits.into_iter().enumerate() {
            rx.recv().map_err(|_| ModelError::RankFailed {
                rank: i,
                reason: "rank thread exited".into(),
            })??;
        }
        Ok(())
    }
}

impl StepGroup for CudaTpGroup {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn block_size(&self) -> usize {
        self.ranks[0].layout.block_size
    }
    fn step(&self, batch: Batch) -> Result<Vec<Vec<f32>>> {
        self.step_with_hook(batch, None)
    }
}
