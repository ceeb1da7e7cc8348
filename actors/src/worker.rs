//! The TpWorker actor: one tensor-parallel rank. It owns the rank's executor — the model
//! shard and KV cache on a dedicated OS thread: the CPU `RankExecutor`, a
//! `CudaRankExecutor` (feature `cuda`) or the tests' CPU stand-in of one, by
//! [`WorkerSpec::device`] (see [`executor`]) — forwards each step to it and lets the executor
//! report straight back through the worker's [`ReportSink`] (a [`WorkerReport::StepDone`]
//! tagged with this worker's epoch; the supervisor points the sink at the Scheduler). The
//! mailbox never waits on compute.
//!
//! Messages: [`WorkerMsg`]. Supervised by the `InstanceSupervisor`, which restarts a failed
//! worker with a new epoch (a fresh executor, shard and KV region) under a restart budget and
//! escalates when the budget is spent. The executor thread of a dead worker exits when its
//! queue closes; reports it still sends carry the old epoch and are dropped. A device-backed
//! executor whose step fails with a device runtime error is presumed lost (CUDA errors are
//! sticky): the worker then fails on purpose, so the supervisor starts a fresh executor.

#[cfg(feature = "cuda")]
mod cuda_peer;
pub mod executor;
mod mirror;
pub mod standin;

pub use executor::RankDevice;
pub use mirror::KvMirror;
pub use pdserve_gpu::tp::UploadCallback;
pub use standin::StandInFaults;

use crate::mailbox::{Inbox, Mailbox};
use executor::RankExec;
use pdserve_gpu::collective::ThreadCollective;
use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::model::Batch;
use pdserve_gpu::tp::{KvFeed, LayerHook, StepCallback, TpOptions};
use pdserve_gpu::weights::TensorStore;
use pdserve_gpu::ModelError;
use pdserve_runtime::memory::HostMemoryAllocator;
use pdserve_runtime::supervision::ActorKind;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;

/// Messages of a TpWorker.
pub enum WorkerMsg {
    /// Run one forward step.
    Step {
        /// Step id (echoed in the report).
        step_id: u64,
        /// The batch.
        batch: Arc<Batch>,
        /// Called as each layer's K/V land in this rank's cache (pushed KV hand-offs).
        hook: Option<LayerHook>,
        /// Writes KV restored from the tiers into this rank's cache layer by layer, before
        /// attention reads each layer (CPU executor only: the tiers are refused elsewhere).
        feed: Option<KvFeed>,
    },
    /// A peer rank died: fail any collective this group waits in.
    Poison(String),
    /// A job on this rank's KV cache (a KV tier spill or restore), queued on the executor in
    /// message order: after the steps cast before it, before those cast after it. A full
    /// queue drops it (its batch then reports failure).
    Kv(pdserve_gpu::tp::KvJob),
    /// Copy `blocks` (every layer) from the KV mirror, where a transfer landed them, to the
    /// device, queued after the steps cast before it; `done` runs once it completed (at once
    /// on the CPU executor). A refused upload (queue full, executor gone) calls `done` with
    /// the error.
    UploadKv {
        /// The blocks that landed.
        blocks: Vec<u32>,
        /// Where the outcome goes.
        done: UploadCallback,
    },
    /// The executor's device is lost (a step failed with a device runtime error): the worker
    /// fails, so its supervisor starts a fresh executor.
    DeviceLost(String),
}

/// A TpWorker's typed address: what the Scheduler sends a rank. A rank that is gone loses
/// the message (counted, see [`Mailbox::tell`]); its supervisor reports the death to the
/// Scheduler (`WorkerDown`), which fails the step or job the rank held.
#[derive(Clone, Debug)]
pub struct WorkerHandle(Mailbox<WorkerMsg>);

impl WorkerHandle {
    /// The handle of the worker behind `mailbox`.
    pub fn new(mailbox: Mailbox<WorkerMsg>) -> Self {
        Self(mailbox)
    }

    fn tell(&self, what: &'static str, msg: WorkerMsg) -> bool {
        self.0.tell(ActorKind::TpWorker, what, msg)
    }

    /// Runs one forward step.
    pub fn step(
        &self,
        step_id: u64,
        batch: Arc<Batch>,
        hook: Option<LayerHook>,
        feed: Option<KvFeed>,
    ) {
        self.tell(
            "step",
            WorkerMsg::Step {
                step_id,
                batch,
                hook,
                feed,
            },
        );
    }

    /// A peer rank died: fail any collective this rank waits in.
    pub fn poison(&self, reason: String) {
        self.tell("poison", WorkerMsg::Poison(reason));
    }

    /// Queues a job on the rank's KV cache (a job never run is dropped with the message;
    /// its batch then offers nothing and still completes).
    pub fn kv(&self, job: pdserve_gpu::tp::KvJob) {
        self.tell("kv", WorkerMsg::Kv(job));
    }

    /// Copies landed `blocks` from the KV mirror to the device; `done` gets the outcome.
    /// Returns whether the message was queued (a worker that is gone never calls `done`).
    pub fn upload_kv(&self, blocks: Vec<u32>, done: UploadCallback) -> bool {
        self.tell("upload_kv", WorkerMsg::UploadKv { blocks, done })
    }
}

/// Why a forward step failed on a rank, or a rank could not report on it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StepError {
    /// The rank's executor failed the step, or refused it (its queue full, its thread gone):
    /// the model's error, as the executor reported it.
    #[error(transparent)]
    RankFailed(Arc<ModelError>),
    /// The rank's report could not be delivered: the scheduler it goes to is gone.
    #[error("the scheduler is gone")]
    SchedulerGone,
}

impl From<ModelError> for StepError {
    fn from(e: ModelError) -> Self {
        Self::RankFailed(Arc::new(e))
    }
}

/// What a worker reports.
pub enum WorkerReport {
    /// The worker (re)started and is ready for steps.
    Up {
        /// Rank.
        rank: usize,
        /// Its epoch (reports of older epochs are stale).
        epoch: u64,
        /// Where to send its steps.
        worker: WorkerHandle,
    },
    /// A step ended on this rank.
    StepDone {
        /// The worker's epoch.
        epoch: u64,
        /// Which step.
        step_id: u64,
        /// Which rank.
        rank: usize,
        /// Logits (rank 0) or the failure.
        result: Result<Vec<Vec<f32>>, StepError>,
    },
}

/// Where a worker's reports go; `Err` when the receiver is gone.
pub type ReportSink = Arc<dyn Fn(WorkerReport) -> Result<(), StepError> + Send + Sync>;

/// What every rank of an instance is built from (shared by ranks and restarts).
#[derive(Clone)]
pub struct WorkerSpec {
    /// Model shape.
    pub config: ModelConfig,
    /// All weights (each rank cuts its own shard).
    pub store: Arc<TensorStore>,
    /// TP degree, pool size, block size, weight format.
    pub opts: TpOptions,
    /// Where KV regions come from.
    pub alloc: Arc<dyn HostMemoryAllocator>,
    /// Test-only fault injection (the instance's injector: the supervisor's panic hooks).
    pub faults: Option<Arc<pdserve_runtime::faults::FaultInjector>>,
    /// Where the ranks run (CPU, CUDA, the tests' stand-in) and their KV mirror.
    pub device: RankDevice,
}

/// Everything one incarnation of one rank's worker needs.
#[derive(Clone)]
pub struct WorkerArgs {
    /// Rank index.
    pub rank: usize,
    /// Epoch of this incarnation.
    pub epoch: u64,
    /// The instance-wide part.
    pub spec: WorkerSpec,
    /// This rank's end of the group's collective.
    pub comm: ThreadCollective,
    /// Where its reports go.
    pub reports: ReportSink,
    /// The instance's hand-off context (instances that move KV): a CUDA rank registers its
    /// side of same-GPU P/D there ([`crate::handoff::context::KvContext::set_device`]).
    pub kv: Option<Arc<crate::handoff::context::KvContext>>,
}

/// The TpWorker actor (its mailbox count).
#[derive(Debug)]
pub struct TpWorker(pub Inbox);

/// A worker's state.
pub struct WorkerState {
    args: WorkerArgs,
    executor: RankExec,
}

impl Actor for TpWorker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: WorkerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        // Cutting the shard and mapping the KV region are blocking work: off the async threads.
        let a = args.clone();
        let want_peer = args.kv.is_some();
        let (executor, device_peer) = tokio::task::spawn_blocking(move || {
            RankExec::spawn(&a.spec, a.comm.clone(), a.spec.alloc.as_ref()).map(|e| {
                let peer = if want_peer { e.device_kv_peer() } else { None };
                (e, peer)
            })
        })
        .await??;
        if let (Some(kv), Some(peer)) = (&args.kv, device_peer) {
            kv.set_device(args.rank, Some(peer));
        }
        (args.reports)(WorkerReport::Up {
            rank: args.rank,
            epoch: args.epoch,
            worker: WorkerHandle::new(Mailbox::of(&myself, &self.0)),
        })?;
        tracing::info!(
            rank = args.rank,
            epoch = args.epoch,
            device = args.spec.device.name(),
            mirror = ?args.spec.device.mirror(),
            "TP worker ready"
        );
        Ok(WorkerState { args, executor })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Peers must not copy from (or into) the regions of an executor that is going away;
        // a restarted rank registers its new regions.
        if let Some(kv) = &st.args.kv {
            if st.executor.device_backed() {
                kv.set_device(st.args.rank, None);
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            WorkerMsg::Step {
                step_id,
                batch,
                hook,
                feed,
            } => {
                let reports = st.args.reports.clone();
                let (rank, epoch) = (st.args.rank, st.args.epoch);
                // A device-backed executor that fails with a device error is lost: tell the
                // worker (after the failure is reported, so the step fails first).
                let lost_to = st
                    .executor
                    .device_backed()
                    .then(|| Mailbox::of(&myself, &self.0));
                let done: StepCallback = Box::new(move |result| {
                    let lost = match (&result, lost_to) {
                        (Err(e), Some(me)) if executor::device_lost(e) => Some((me, e.to_string())),
                        _ => None,
                    };
                    let result = result.map_err(StepError::from);
                    let _ = reports(WorkerReport::StepDone {
                        epoch,
                        step_id,
                        rank,
                        result,
                    });
                    if let Some((me, reason)) = lost {
                        me.tell(
                            ActorKind::TpWorker,
                            "device_lost",
                            WorkerMsg::DeviceLost(reason),
                        );
                    }
                });
                if let Err(e) = st.executor.submit(batch, hook, feed, done) {
                    (st.args.reports)(WorkerReport::StepDone {
                        epoch,
                        step_id,
                        rank,
                        result: Err(e.into()),
                    })?;
                }
            }
            WorkerMsg::Poison(reason) => st.executor.poison(&reason),
            WorkerMsg::Kv(job) => {
                if let Err(e) = st.executor.submit_kv(job) {
                    tracing::warn!(rank = st.args.rank, error = %e, "KV tier job dropped");
                }
            }
            WorkerMsg::UploadKv { blocks, done } => {
                // A refused job is dropped with its callback: keep `done` in a slot both the
                // queued job and the refusal can take it from (exactly once).
                let slot = Arc::new(std::sync::Mutex::new(Some(done)));
                let take = |slot: &std::sync::Mutex<Option<UploadCallback>>| {
                    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
                };
                let queued_slot = slot.clone();
                let queued: UploadCallback = Box::new(move |r| {
                    if let Some(f) = take(&queued_slot) {
                        f(r)
                    }
                });
                if let Err(e) = st.executor.upload_kv(blocks, queued) {
                    tracing::warn!(rank = st.args.rank, error = %e, "KV upload refused");
                    if let Some(f) = take(&slot) {
                        f(Err(e));
                    }
                }
            }
            WorkerMsg::DeviceLost(reason) => {
                tracing::error!(rank = st.args.rank, %reason, "device lost: restarting the rank");
                return Err(format!("TP rank {}: device lost: {reason}", st.args.rank).into());
            }
        }
        Ok(())
    }
}
