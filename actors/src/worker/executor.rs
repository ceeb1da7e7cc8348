//! What a TpWorker runs its rank on: [`RankDevice`] (chosen per instance: `model.device`,
//! or the test-only stand-in) and [`RankExec`], the one small enum over the executors that
//! share the rank contract (`submit` a step, `poison` the group) and differ in where the KV
//! cache lives:
//!
//! | executor | KV cache | what the transfer engine registers | landed KV |
//! |---|---|---|---|
//! | CPU `RankExecutor` | host, from the engine's allocator | the cache itself | in place |
//! | `CudaRankExecutor` (feature `cuda`) | device | the host mirror | uploaded |
//! | [`StandInExecutor`] (tests) | private host memory | the host mirror | uploaded |
//!
//! Executors with a private cache ([`RankDevice::private_kv`]) need an upload of KV that a
//! transfer landed in the mirror before a step may read it ([`RankExec::upload_kv`]; on the
//! CPU executor it completes at once), and refuse jobs on the host cache
//! ([`RankExec::submit_kv`]: the KV tiers are refused at start for them).

use super::mirror::KvMirror;
use super::standin::{StandInExecutor, StandInFaults};
use super::WorkerSpec;
use pdserve_gpu::collective::ThreadCollective;
use pdserve_gpu::device::DeviceError;
use pdserve_gpu::model::Batch;
use pdserve_gpu::tp::{KvFeed, KvJob, LayerHook, RankExecutor, StepCallback, UploadCallback};
use pdserve_gpu::ModelError;
use pdserve_runtime::memory::HostMemoryAllocator;
use pdserve_runtime::Role;
use std::sync::Arc;

/// Where an instance's ranks run.
#[derive(Clone, Debug, Default)]
pub enum RankDevice {
    /// The CPU backend (`model.device = cpu`): KV in host memory the engine registers.
    #[default]
    Cpu,
    /// CUDA (`model.device = cuda[:N]`): rank `r` on GPU `first_gpu + r`.
    #[cfg(feature = "cuda")]
    Cuda {
        /// GPU of rank 0.
        first_gpu: usize,
        /// Matmul weight type (`model.dtype`).
        dtype: pdserve_gpu::cuda::GemmDtype,
        /// The KV mirror (by role).
        mirror: KvMirror,
    },
    /// Test-only: the CPU stand-in with the CUDA executor's memory contract
    /// ([`StandInExecutor`]), selected by tests, never by a driver.
    StandIn {
        /// The KV mirror (by role).
        mirror: KvMirror,
        /// Its fault switches.
        faults: Arc<StandInFaults>,
    },
}

impl RankDevice {
    /// The ranks of `device` (`model.device`), with matmul weights of `dtype` (`model.dtype`,
    /// CUDA only), for an instance of `role` (which picks the KV mirror).
    ///
    /// # Errors
    /// [`DeviceError::NotBuilt`] for CUDA in a build without the `cuda` feature; a `dtype`
    /// CUDA does not take.
    pub fn for_device(
        device: pdserve_gpu::device::Device,
        dtype: &str,
        role: Role,
    ) -> Result<Self, DeviceError> {
        use pdserve_gpu::device::Device;
        let _ = (dtype, role);
        match device {
            Device::Cpu => Ok(Self::Cpu),
            #[cfg(feature = "cuda")]
            Device::Cuda { ordinal } => Ok(Self::Cuda {
                first_gpu: ordinal,
                dtype: dtype.parse()?,
                mirror: KvMirror::for_role(role),
            }),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda { .. } => Err(DeviceError::NotBuilt),
        }
    }

    /// Whether KV lives in memory the transfer engine does not see (device memory): landed
    /// KV must be uploaded, and nothing may read the cache as host memory (KV tiers).
    pub fn private_kv(&self) -> bool {
        !matches!(self, Self::Cpu)
    }

    /// The KV mirror (`Off` on CPU, where the cache itself is registered).
    pub fn mirror(&self) -> KvMirror {
        match self {
            Self::Cpu => KvMirror::Off,
            #[cfg(feature = "cuda")]
            Self::Cuda { mirror, .. } => *mirror,
            Self::StandIn { mirror, .. } => *mirror,
        }
    }

    /// A short name for logs (`cpu`, `cuda`, `stand-in`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Self::Cuda { .. } => "cuda",
            Self::StandIn { .. } => "stand-in",
        }
    }
}

/// One rank's executor, whichever backend runs it.
#[derive(Debug)]
pub(crate) enum RankExec {
    /// The CPU backend.
    Cpu(RankExecutor),
    /// A GPU.
    #[cfg(feature = "cuda")]
    Cuda(Arc<pdserve_gpu::cuda::CudaRankExecutor>),
    /// The CPU stand-in of a GPU (tests).
    StandIn(StandInExecutor),
}

impl RankExec {
    /// Starts rank `comm.rank()` on `spec.device`, its KV (or KV mirror) allocated through
    /// `alloc`. Blocking: call off the async threads.
    pub(crate) fn spawn(
        spec: &WorkerSpec,
        comm: ThreadCollective,
        alloc: &dyn HostMemoryAllocator,
    ) -> Result<Self, ModelError> {
        match &spec.device {
            RankDevice::Cpu => {
                RankExecutor::spawn(&spec.config, &spec.store, comm, &spec.opts, alloc)
                    .map(Self::Cpu)
            }
            #[cfg(feature = "cuda")]
            RankDevice::Cuda {
                first_gpu,
                dtype,
                mirror,
            } => {
                use pdserve_gpu::cuda::{CudaOptions, CudaRankExecutor, MirrorMode};
                let mirror = match mirror {
                    KvMirror::Off => MirrorMode::Off,
                    KvMirror::WriteThrough => MirrorMode::WriteThrough,
                    KvMirror::Receive => MirrorMode::Receive,
                };
                let cuda = CudaOptions {
                    first_gpu: *first_gpu,
                    dtype: *dtype,
                    mirror,
                };
                CudaRankExecutor::spawn(
                    &spec.config,
                    &spec.store,
                    comm,
                    &spec.opts,
                    &cuda,
                    Some(alloc),
                )
                .map(|e| Self::Cuda(Arc::new(e)))
            }
            RankDevice::StandIn { mirror, faults } => StandInExecutor::spawn(
                &spec.config,
                &spec.store,
                comm,
                &spec.opts,
                *mirror,
                faults.clone(),
                alloc,
            )
            .map(Self::StandIn),
        }
    }

    /// Queues a forward step; `done` gets the result on the executor's thread. A `feed`
    /// (KV restored from the tiers) is taken by the CPU executor only, like every job on
    /// the host KV cache ([`RankExec::submit_kv`]).
    pub(crate) fn submit(
        &self,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        feed: Option<KvFeed>,
        done: StepCallback,
    ) -> Result<(), ModelError> {
        if feed.is_some() && !matches!(self, Self::Cpu(_)) {
            return Err(DeviceError::Unsupported(
                "KV restored from the tiers writes the host KV cache; this rank's KV is on the device"
                    .into(),
            )
            .into());
        }
        match self {
            Self::Cpu(e) => e.submit_fed(batch, hook, feed, done),
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => e.submit(batch, hook, done),
            Self::StandIn(e) => e.submit(batch, hook, done),
        }
    }

    /// Queues a job on the host KV cache (KV tiers). Executors with a device cache refuse
    /// it (the instance refuses the tiers for them at start).
    pub(crate) fn submit_kv(&self, job: KvJob) -> Result<(), ModelError> {
        match self {
            Self::Cpu(e) => e.submit_kv(job),
            _ => Err(DeviceError::Unsupported(
                "KV tier jobs read the host KV cache; this rank's KV is on the device".into(),
            )
            .into()),
        }
    }

    /// Queues the upload of `blocks` (every layer) from the KV mirror to the device, after
    /// a transfer landed them; `done` runs once it completed (at once on the CPU, whose
    /// cache is where the transfer landed).
    pub(crate) fn upload_kv(
        &self,
        blocks: Vec<u32>,
        done: UploadCallback,
    ) -> Result<(), ModelError> {
        match self {
            Self::Cpu(_) => {
                done(Ok(()));
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => e.upload_kv(blocks, done),
            Self::StandIn(e) => e.upload_kv(blocks, done),
        }
    }

    /// Fails every collective the rank's group waits in (a peer rank died).
    pub(crate) fn poison(&self, reason: &str) {
        match self {
            Self::Cpu(e) => e.poison(reason),
            #[cfg(feature = "cuda")]
            Self::Cuda(e) => e.poison(reason),
            Self::StandIn(e) => e.poison(reason),
        }
    }

    /// This rank's side of same-GPU P/D over CUDA IPC (`handoff::device`), for the
    /// instance's KV context: only a CUDA rank has one. Blocking (exports the IPC handles on
    /// the rank's thread): call off the async threads.
    pub(crate) fn device_kv_peer(
        &self,
    ) -> Option<Arc<dyn crate::handoff::device_kv::DeviceKvPeer>> {
        #[cfg(feature = "cuda")]
        if let Self::Cuda(e) = self {
            return Some(Arc::new(super::cuda_peer::CudaKvPeer::new(e.clone())));
        }
        None
    }

    /// Whether this executor keeps KV on a device (not the CPU executor).
    pub(crate) fn device_backed(&self) -> bool {
        !matches!(self, Self::Cpu(_))
    }
}

/// Whether a step failure `e` of a device-backed executor means it cannot run any more
/// steps: a device runtime error (CUDA's errors are sticky to the context, so later steps
/// would fail too). The worker then stops, and its supervisor starts a fresh executor.
pub(crate) fn device_lost(e: &ModelError) -> bool {
    matches!(e, ModelError::Device(DeviceError::Runtime { .. }))
}
