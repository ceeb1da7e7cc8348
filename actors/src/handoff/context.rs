//! What both hand-off actors share about their instance: [`KvContext`] (identity, KV memory,
//! bounds, figures, the hand-off tasks), and [`KvRegistry`], this instance's KV regions as
//! registered with its transfer engine.

use super::aggregator::{DroppedReports, Epochs};
use super::device_kv::{placement_of, DeviceKvPeer};
use super::host_proof::{boot_id, HostProofs, PublishedProof};
use super::peer::Peers;
use super::protocol::{compat_hash, compat_key, HandoffError, KvPeerInfo, RankKv};
use super::pull::PullBounds;
use super::session::{Grants, Security};
use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::kv::{KvDtype, KvLayout};
use pdserve_runtime::faults::{Fault, FaultInjector, TransferFault};
use pdserve_runtime::ids::RequestId;
use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_transport::{RegisteredRegion, TransferEngine, TransferOp};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// This instance's KV regions, registered with its transfer engine, per TP rank.
pub struct KvRegistry {
    engine: Arc<TransferEngine>,
    ranks: Mutex<Vec<Vec<RegisteredRegion>>>,
    faults: Option<Arc<FaultInjector>>,
}

impl KvRegistry {
    /// An empty registry for `tp` ranks (registrations fail as `faults` draws).
    pub fn new(
        engine: Arc<TransferEngine>,
        tp: usize,
        faults: Option<Arc<FaultInjector>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine,
            ranks: Mutex::new((0..tp).map(|_| Vec::new()).collect()),
            faults,
        })
    }

    /// The transfer engine.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// An allocator for one incarnation of rank `rank`: its first allocation replaces the
    /// rank's previous regions (a restarted worker gets a fresh cache).
    pub fn allocator_for(self: &Arc<Self>, rank: usize) -> Arc<dyn HostMemoryAllocator> {
        Arc::new(RankAllocator {
            registry: self.clone(),
            rank,
            fresh: AtomicBool::new(true),
        })
    }

    fn region_ids(&self) -> Vec<Vec<u64>> {
        let ranks = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
        ranks
            .iter()
            .map(|r| r.iter().map(RegisteredRegion::id).collect())
            .collect()
    }
}

struct RankAllocator {
    registry: Arc<KvRegistry>,
    rank: usize,
    fresh: AtomicBool,
}

impl HostMemoryAllocator for RankAllocator {
    fn allocate(&self, len: usize) -> std::io::Result<Arc<dyn HostMemory>> {
        if let Some(f) = &self.registry.faults {
            if f.roll(Fault::RegisterFail) {
                return Err(std::io::Error::other(
                    "injected fault: KV memory registration failed",
                ));
            }
        }
        let mem = self.registry.engine.allocator().allocate(len)?;
        let region = self
            .registry
            .engine
            .register(mem.clone())
            .map_err(std::io::Error::other)?;
        let mut ranks = self
            .registry
            .ranks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if self.fresh.swap(false, Ordering::SeqCst) {
            ranks[self.rank].clear();
        }
        ranks[self.rank].push(region);
        Ok(mem)
    }
}

/// How KV moves from prefill to decode when the decode instance drives the hand-off: the
/// config's `transfer.mode` enum (`pull` or `push`).
pub use pdserve_runtime::config::TransferMode;

/// Hand-off figures of one instance (for `inspect` and metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvFigures {
    /// Hand-offs in progress (pushes being written, pulls being read).
    pub transfers_in_flight: u64,
    /// KV bytes written to decode instances.
    pub bytes_sent: u64,
    /// KV bytes read from prefill instances.
    pub bytes_received: u64,
    /// Hand-offs that failed.
    pub failures: u64,
    /// Rank reports the Aggregator dropped as stale (older epoch or attempt).
    pub stale_reports: u64,
    /// Rank reports the Aggregator dropped as duplicates.
    pub duplicate_reports: u64,
    /// Decode side: hand-offs that completed.
    #[serde(default)]
    pub handoffs_done: u64,
    /// Decode side: prompt blocks those hand-offs moved in (all TP ranks' heads each).
    #[serde(default)]
    pub blocks_moved: u64,
    /// Decode side: prompt blocks those hand-offs did not move because this instance's
    /// prefix cache held them (delta transfer).
    #[serde(default)]
    pub blocks_skipped: u64,
    /// KV bytes of one block over all TP ranks (K and V, every layer).
    #[serde(default)]
    pub block_bytes: u64,
}

/// How an instance takes part in KV hand-offs ([`KvContext::new`]).
#[derive(Clone)]
pub struct KvSettings {
    /// Instance name (the engine id peers see).
    pub engine_id: String,
    /// Model shape.
    pub model: ModelConfig,
    /// TP ranks.
    pub tp: usize,
    /// Blocks per rank.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Element type of the cache.
    pub dtype: KvDtype,
    /// Bounds on the hand-off's steps.
    pub bounds: PullBounds,
    /// How this instance, as decode, asks for a prompt's KV when it drives the hand-off.
    pub mode: TransferMode,
    /// As decode: prompts shorter than this are prefilled here instead of remotely
    /// (conditional disaggregation); 0 disaggregates every prompt.
    pub min_remote_prompt_tokens: usize,
    /// As prefill: how long held blocks wait for the reader (published with them).
    pub lease: Duration,
    /// Test-only fault injection at the transfer and control-message points.
    pub faults: Option<Arc<FaultInjector>>,
}

/// What the KV hand-off needs to know about this instance.
pub struct KvContext {
    /// How it takes part.
    pub settings: KvSettings,
    /// Regions per rank.
    pub registry: Arc<KvRegistry>,
    /// The client side of the peer protocol (handshakes, sessions, leases).
    pub peers: Arc<Peers>,
    /// Per-rank epochs (see [`Epochs`]).
    pub epochs: Arc<Epochs>,
    /// Reports the Aggregator dropped.
    pub dropped: Arc<DroppedReports>,
    /// The transfer sessions this instance granted (as the target of a hand-off).
    pub grants: Grants,
    /// Every hand-off task of the instance (drained at shutdown, see `Instance::stop`).
    pub tasks: TaskTracker,
    /// Cancelled when the instance stops: tasks that wait on their own (lease renewals) end.
    pub shutdown: CancellationToken,
    /// Cancelled when the instance starts to stop: ends the timers of [`KvContext::tasks`]
    /// (e.g. the sweep of expired read scopes), so draining waits only for hand-offs.
    pub background: CancellationToken,
    handoffs: dashmap::DashMap<RequestId, CancellationToken>,
    /// Per TP rank, its device KV when it lives on a GPU (see [`KvContext::set_device`]).
    devices: Mutex<Vec<Option<Arc<dyn DeviceKvPeer>>>>,
    /// This host's proof files, and ours once a rank registered a device.
    proofs: HostProofs,
    proof: Mutex<Option<PublishedProof>>,
    orphan_writes_until: Mutex<Option<Instant>>,
    in_flight: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    failures: AtomicU64,
    handoffs_done: AtomicU64,
    blocks_moved: AtomicU64,
    blocks_skipped: AtomicU64,
}

impl KvContext {
    /// A context for an instance.
    pub fn new(
        settings: KvSettings,
        registry: Arc<KvRegistry>,
        peers: Arc<Peers>,
        epochs: Arc<Epochs>,
    ) -> Self {
        let shutdown = CancellationToken::new();
        let settings_tp = settings.tp;
        Self {
            background: shutdown.child_token(),
            grants: Grants::new(registry.engine().clone()),
            settings,
            registry,
            peers,
            epochs,
            dropped: Arc::new(DroppedReports::default()),
            tasks: TaskTracker::new(),
            shutdown,
            handoffs: dashmap::DashMap::new(),
            devices: Mutex::new(vec![None; settings_tp]),
            proofs: HostProofs::from_env(),
            proof: Mutex::new(None),
            orphan_writes_until: Mutex::new(None),
            in_flight: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            handoffs_done: AtomicU64::new(0),
            blocks_moved: AtomicU64::new(0),
            blocks_skipped: AtomicU64::new(0),
        }
    }

    /// Bounds of each step.
    pub fn bounds(&self) -> PullBounds {
        self.settings.bounds
    }

    /// Hand-off figures so far.
    pub fn figures(&self) -> KvFigures {
        KvFigures {
            transfers_in_flight: self.in_flight.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            stale_reports: self.dropped.stale.load(Ordering::Relaxed),
            duplicate_reports: self.dropped.duplicate.load(Ordering::Relaxed),
            handoffs_done: self.handoffs_done.load(Ordering::Relaxed),
            blocks_moved: self.blocks_moved.load(Ordering::Relaxed),
            blocks_skipped: self.blocks_skipped.load(Ordering::Relaxed),
            block_bytes: self.block_bytes(),
        }
    }

    /// KV bytes of one block over all TP ranks (K and V, every layer).
    pub fn block_bytes(&self) -> u64 {
        let s = &self.settings;
        (2 * s.model.num_layers * s.model.num_kv_heads * s.block_size * s.model.head_dim) as u64
            * s.dtype.size() as u64
    }

    /// Decode side: a hand-off completed, moving `moved` blocks and skipping `skipped` that
    /// the prefix cache held.
    pub(crate) fn handoff_moved(&self, moved: u64, skipped: u64) {
        use pdserve_runtime::telemetry as m;
        self.handoffs_done.fetch_add(1, Ordering::Relaxed);
        self.blocks_moved.fetch_add(moved, Ordering::Relaxed);
        self.blocks_skipped.fetch_add(skipped, Ordering::Relaxed);
        metrics::histogram!(m::KV_TRANSFER_BYTES_PER_REQUEST)
            .record((moved * self.block_bytes()) as f64);
    }

    /// What this instance's transfer backend offers the hand-off (keys, fences).
    pub fn security(&self) -> Security {
        self.grants.security()
    }

    /// Our ranks' layouts and their region ids (`regions[r][layer]`), for transfer scopes.
    pub fn memory(&self) -> (Vec<KvLayout>, Vec<Vec<u64>>) {
        let info = self.info();
        info.ranks
            .into_iter()
            .map(|r| (r.layout, r.regions))
            .unzip()
    }

    /// What this instance publishes: the answer to [`PeerRequest::Info`] and the target of a
    /// push.
    ///
    /// [`PeerRequest::Info`]: super::protocol::PeerRequest::Info
    pub fn info(&self) -> KvPeerInfo {
        let s = &self.settings;
        let k = s.model.num_kv_heads;
        let regions = self.registry.region_ids();
        let layout = |heads: usize| KvLayout {
            num_layers: s.model.num_layers,
            num_blocks: s.num_blocks,
            block_size: s.block_size,
            num_kv_heads: heads,
            head_dim: s.model.head_dim,
            dtype: s.dtype,
        };
        let key = compat_key(&s.model, s.block_size, &layout(k / s.tp));
        KvPeerInfo {
            engine_id: s.engine_id.clone(),
            compat_hash: compat_hash(&key),
            compat_key: key,
            transfer_addr: self.registry.engine.address(),
            backend: self.registry.engine.backend().as_str().to_string(),
            num_kv_heads: k,
            ranks: (0..s.tp)
                .map(|r| RankKv {
                    heads: (r * k / s.tp, (r + 1) * k / s.tp),
                    layout: layout(k / s.tp),
                    regions: regions.get(r).cloned().unwrap_or_default(),
                })
                .collect(),
        }
    }

    /// Registers (or, with `None`, clears) rank `rank`'s device KV: the TpWorker calls it once
    /// its CUDA executor runs, and with `None` when the executor goes. The first registration
    /// publishes this process's host proof; without any, the instance advertises no placement
    /// and every hand-off takes the host path.
    pub fn set_device(&self, rank: usize, device: Option<Arc<dyn DeviceKvPeer>>) {
        if device.is_some() {
            let mut proof = self.proof.lock().unwrap_or_else(|e| e.into_inner());
            if proof.is_none() {
                match self.proofs.publish(&self.settings.engine_id, boot_id()) {
                    Ok(p) => *proof = Some(p),
                    Err(e) => tracing::warn!(
                        dir = %self.proofs.dir().display(),
                        error = %e,
                        "cannot publish a host proof: KV hand-offs keep the host path"
                    ),
                }
            }
        }
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = devices.get_mut(rank) {
            *slot = device;
        }
    }

    /// Rank `rank`'s device KV, when it registered one.
    pub fn device(&self, rank: usize) -> Option<Arc<dyn DeviceKvPeer>> {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.get(rank).cloned().flatten()
    }

    /// Where this instance keeps its KV, with its IPC handles (the placement exchange strips
    /// them for peers not verified as local): `None` when no rank registered a device or no
    /// host proof could be published.
    pub fn placement(&self) -> Option<pdserve_core::handoff::kv_path::KvPlacement> {
        let identity = self
            .proof
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()?
            .identity
            .clone();
        let devices = self
            .devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        placement_of(&self.settings.engine_id, &identity, &self.info(), &devices)
    }

    /// This host's proof files.
    pub fn host_proofs(&self) -> &HostProofs {
        &self.proofs
    }

    /// A hand-off starts (counted in flight until [`KvContext::handoff_ended`]).
    pub(crate) fn handoff_started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A hand-off ended; a failure is counted by its kind.
    pub(crate) fn handoff_ended(&self, result: Result<(), &HandoffError>) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Err(e) = result {
            self.failed(e);
        }
    }

    /// Counts a failed hand-off by kind.
    pub(crate) fn failed(&self, e: &HandoffError) {
        use pdserve_runtime::telemetry as m;
        self.failures.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::KV_TRANSFER_FAILURES_TOTAL, m::LABEL_KIND => e.kind()).increment(1);
    }

    /// Bytes written to a peer.
    pub(crate) fn sent(&self, bytes: u64) {
        use pdserve_runtime::telemetry as m;
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        metrics::counter!(m::KV_TRANSFER_BYTES_TOTAL, m::LABEL_DIRECTION => "sent")
            .increment(bytes);
    }

    /// Bytes read from a peer.
    pub(crate) fn received(&self, bytes: u64) {
        use pdserve_runtime::telemetry as m;
        self.bytes_received.fetch_add(bytes, Ordering::Relaxed);
        metrics::counter!(m::KV_TRANSFER_BYTES_TOTAL, m::LABEL_DIRECTION => "received")
            .increment(bytes);
    }

    /// Registers the cancel handle of request `id`'s hand-off.
    pub(crate) fn track_handoff(&self, id: RequestId) -> CancellationToken {
        let cancel = self.shutdown.child_token();
        self.handoffs.insert(id, cancel.clone());
        cancel
    }

    /// Forgets request `id`'s hand-off.
    pub(crate) fn untrack_handoff(&self, id: RequestId) {
        self.handoffs.remove(&id);
    }

    /// Cancels request `id`'s hand-off, whichever KvReceiver incarnation started it.
    pub(crate) fn cancel_handoff(&self, id: RequestId) {
        if let Some(c) = self.handoffs.get(&id) {
            c.cancel();
        }
    }

    /// A KvSender failed with pushes open: their writes may land for one more transfer bound.
    pub(crate) fn orphan_writes_until(&self, until: Instant) {
        *self
            .orphan_writes_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(until);
    }

    /// Until when writes of a failed KvSender incarnation may still land, if ever.
    pub(crate) fn orphan_writes_deadline(&self) -> Option<Instant> {
        *self
            .orphan_writes_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Applies an injected transfer fault to a batch about to be submitted: fails it, delays
    /// it, points one span outside its region (the engine must refuse it), or silently damages
    /// one block (see [`KvContext::damage_block`]).
    ///
    /// # Errors
    /// The injected failure.
    pub(crate) async fn transfer_fault(
        &self,
        ops: &mut Vec<TransferOp>,
    ) -> Result<(), HandoffError> {
        match self
            .settings
            .faults
            .as_ref()
            .map_or(TransferFault::Submit, |f| f.transfer())
        {
            TransferFault::Submit => Ok(()),
            TransferFault::Fail => Err(HandoffError::Injected("the KV transfer failed".into())),
            TransferFault::Delay(d) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            TransferFault::Corrupt => {
                if let Some(op) = ops.first_mut() {
                    op.remote_offset = u64::MAX / 4;
                }
                Ok(())
            }
            TransferFault::SkipBlock => {
                self.damage_block(ops, false);
                Ok(())
            }
            TransferFault::GarbleBlock => {
                self.damage_block(ops, true);
                Ok(())
            }
        }
    }

    /// Test-only silent damage to the batch's first block (the block of its first span, on our
    /// side: the destination of a read, the source of a write), in every layer and head range
    /// the batch covers: with `garble`, each of its key spans takes its bytes from the matching
    /// value span; without, its spans are left out. The batch stays valid, so the hand-off
    /// completes and only the tokens decoded from that KV can tell.
    fn damage_block(&self, ops: &mut Vec<TransferOp>, garble: bool) {
        use pdserve_transport::OpKind;
        let Some(first) = ops.first() else {
            return;
        };
        // Our rank's layout: every span sits at (K or V) * half + block * block + heads.
        let layout = &self.info().ranks[0].layout;
        let (block, half) = (
            layout.block_bytes() as u64,
            layout.region_bytes() as u64 / 2,
        );
        // (K or V, block, offset inside the block) of a span, on our side.
        let place = |op: &TransferOp| {
            let o = op.local_offset;
            (o / half, (o % half) / block, o % block)
        };
        let target = place(first).1;
        if !garble {
            ops.retain(|op| place(op).1 != target);
            return;
        }
        let source = |op: &TransferOp| match op.kind {
            OpKind::Read => (op.remote_region, op.remote_offset),
            OpKind::Write => (op.local_region, op.local_offset),
        };
        let values: Vec<_> = ops
            .iter()
            .filter(|op| matches!(place(op), (1, b, _) if b == target))
            .map(|op| (op.local_region, place(op).2, source(op)))
            .collect();
        for op in ops.iter_mut() {
            let (kind, b, inner) = place(op);
            if kind != 0 || b != target {
                continue;
            }
            let value = values
                .iter()
                .find(|(region, at, _)| *region == op.local_region && *at == inner);
            if let Some(&(_, _, (region, offset))) = value {
                match op.kind {
                    OpKind::Read => (op.remote_region, op.remote_offset) = (region, offset),
                    OpKind::Write => (op.local_region, op.local_offset) = (region, offset),
                }
            }
        }
    }
}
