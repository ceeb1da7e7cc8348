//! The decode side's KV hand-off: the KvReceiver actor and the registry of this instance's KV
//! regions in its transfer engine.
//!
//! A request that arrives with `kv_transfer_params.do_remote_prefill` gets its destination
//! blocks from the Scheduler (state `WaitingForRemoteKv`) and a `Pull` here. The receiver
//! fetches and validates the prefill instance's published KV layout (cached per peer), opens a
//! transfer session (cached per peer), reads every (layer, K/V, block, head range) the request
//! owns into its blocks, then releases the prefill side's lease. The release answer says
//! whether the lease was still alive: if it had expired, the blocks may have been reused while
//! we read, and the request fails loudly instead of decoding from garbage. The receiver keeps a
//! share of the destination blocks until its reads are finished, so an abort never lets them be
//! reused while bytes may still land. The pull runs on a task; the mailbox never waits.
//!
//! Supervised by the `InstanceSupervisor`; a failure escalates.

use crate::block_manager::BlockAllocation;
use crate::kv_transfer::{compat_hash, compat_key, plan_pull, validate_peer, KvPeerInfo, RankKv};
use crate::scheduler::SchedulerMsg;
use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::kv::{KvDtype, KvLayout};
use pdserve_runtime::ids::{RequestId, TransferId};
use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_transport::{RegisteredRegion, Session, TransferEngine};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// This instance's KV regions, registered with its transfer engine, per TP rank.
pub struct KvRegistry {
    engine: Arc<TransferEngine>,
    ranks: Mutex<Vec<Vec<RegisteredRegion>>>,
}

impl KvRegistry {
    /// An empty registry for `tp` ranks.
    pub fn new(engine: Arc<TransferEngine>, tp: usize) -> Arc<Self> {
        Arc::new(Self {
            engine,
            ranks: Mutex::new((0..tp).map(|_| Vec::new()).collect()),
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

/// What the KV hand-off needs to know about this instance.
pub struct KvContext {
    /// Instance name (the engine id peers see).
    pub engine_id: String,
    /// Regions per rank.
    pub registry: Arc<KvRegistry>,
    /// Model shape.
    pub model: ModelConfig,
    /// TP ranks.
    pub tp: usize,
    /// Blocks per rank.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Bound on every step of a hand-off (layout fetch, connect, reads, release).
    pub timeout: Duration,
    http: reqwest::Client,
    peers: tokio::sync::Mutex<HashMap<String, KvPeerInfo>>,
    sessions: tokio::sync::Mutex<HashMap<String, Arc<Session>>>,
}

impl KvContext {
    /// A context for an instance.
    pub fn new(
        engine_id: String,
        registry: Arc<KvRegistry>,
        model: ModelConfig,
        tp: usize,
        num_blocks: usize,
        block_size: usize,
        timeout: Duration,
    ) -> Self {
        Self {
            engine_id,
            registry,
            model,
            tp,
            num_blocks,
            block_size,
            timeout,
            http: reqwest::Client::builder()
                .no_proxy()
                .timeout(timeout)
                .build()
                .unwrap_or_default(),
            peers: tokio::sync::Mutex::new(HashMap::new()),
            sessions: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// What this instance publishes at `GET /v1/kv/info`.
    pub fn info(&self) -> KvPeerInfo {
        let k = self.model.num_kv_heads;
        let regions = self.registry.region_ids();
        let layout = |heads: usize| KvLayout {
            num_layers: self.model.num_layers,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            num_kv_heads: heads,
            head_dim: self.model.head_dim,
            dtype: KvDtype::F32,
        };
        let key = compat_key(&self.model, self.block_size, &layout(k / self.tp));
        KvPeerInfo {
            engine_id: self.engine_id.clone(),
            compat_hash: compat_hash(&key),
            compat_key: key,
            transfer_addr: self.registry.engine.address(),
            backend: self.registry.engine.backend().as_str().to_string(),
            num_kv_heads: k,
            ranks: (0..self.tp)
                .map(|r| RankKv {
                    heads: (r * k / self.tp, (r + 1) * k / self.tp),
                    layout: layout(k / self.tp),
                    regions: regions.get(r).cloned().unwrap_or_default(),
                })
                .collect(),
        }
    }

    async fn peer_info(&self, url: &str) -> Result<KvPeerInfo, String> {
        if let Some(p) = self.peers.lock().await.get(url) {
            return Ok(p.clone());
        }
        let info: KvPeerInfo = self
            .http
            .get(format!("{url}/v1/kv/info"))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("cannot fetch the KV layout of {url}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("bad KV layout from {url}: {e}"))?;
        validate_peer(&self.info(), &info).map_err(|e| e.to_string())?;
        self.peers
            .lock()
            .await
            .insert(url.to_string(), info.clone());
        Ok(info)
    }

    async fn session(&self, addr: &str) -> Result<Arc<Session>, String> {
        let mut sessions = self.sessions.lock().await;
        if let Some(s) = sessions.get(addr).filter(|s| s.is_alive()) {
            return Ok(s.clone());
        }
        let s = tokio::time::timeout(self.timeout, self.registry.engine.connect(addr))
            .await
            .map_err(|_| format!("connecting to {addr} timed out"))?
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let s = Arc::new(s);
        sessions.insert(addr.to_string(), s.clone());
        Ok(s)
    }

    /// Reads a request's prompt KV from a prefill instance into `local_blocks`, then releases
    /// the prefill side's lease.
    ///
    /// # Errors
    /// Layout mismatches, forged block ids, transfer failures and expired leases, as text.
    pub async fn pull(
        &self,
        remote: &RemotePrefill,
        local_blocks: &[u32],
        prompt_len: usize,
    ) -> Result<(), String> {
        let theirs = self.peer_info(&remote.url).await?;
        let ops = plan_pull(
            &self.info(),
            &theirs,
            local_blocks,
            &remote.block_ids,
            prompt_len,
        )
        .map_err(|e| e.to_string())?;
        let session = self.session(&theirs.transfer_addr).await?;
        // The session's view of the peer's regions is refreshed only when the peer published
        // regions it does not know yet (a restarted peer worker re-registers its cache).
        let known: std::collections::HashSet<u64> =
            session.remote_regions().iter().map(|r| r.id).collect();
        if theirs
            .ranks
            .iter()
            .flat_map(|r| &r.regions)
            .any(|id| !known.contains(id))
        {
            session.refresh_regions().await.map_err(|e| e.to_string())?;
        }
        let batch = session
            .submit(&ops)
            .map_err(|e| format!("KV transfer refused: {e}"))?;
        batch
            .wait(self.timeout)
            .await
            .map_err(|e| format!("KV transfer failed: {e}"))?;
        let released = self
            .http
            .post(format!("{}/v1/kv/release", remote.url))
            .json(&serde_json::json!({"transfer_id": remote.transfer_id.to_string()}))
            .send()
            .await
            .map_err(|e| format!("cannot release the KV lease at {}: {e}", remote.url))?;
        match released.status().as_u16() {
            200 => Ok(()),
            410 => Err(format!("the KV lease of transfer {} expired before the read finished: its blocks may have been reused", remote.transfer_id)),
            s => Err(format!("releasing transfer {} failed with HTTP {s}", remote.transfer_id)),
        }
    }
}

/// Where a request's prompt KV is, from `kv_transfer_params`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemotePrefill {
    /// The hand-off id.
    pub transfer_id: TransferId,
    /// The prefill instance's API (`http://remote_host:remote_port`).
    pub url: String,
    /// Its blocks holding the prompt (`remote_block_ids`).
    pub block_ids: Vec<u32>,
    /// The first token it sampled (T0).
    pub first_token: u32,
}

/// Messages of the KvReceiver.
pub enum KvReceiverMsg {
    /// Read a request's KV into its destination blocks.
    Pull {
        /// Request.
        id: RequestId,
        /// Where it is.
        remote: RemotePrefill,
        /// Our destination blocks (a share, kept until the reads are done).
        blocks: BlockAllocation,
        /// Prompt tokens.
        prompt_len: usize,
        /// Where to report.
        scheduler: ActorRef<SchedulerMsg>,
    },
}

/// The KvReceiver actor.
#[derive(Debug)]
pub struct KvReceiver;

impl Actor for KvReceiver {
    type Msg = KvReceiverMsg;
    type State = Arc<KvContext>;
    type Arguments = Arc<KvContext>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        ctx: Arc<KvContext>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ctx)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        ctx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let KvReceiverMsg::Pull {
            id,
            remote,
            blocks,
            prompt_len,
            scheduler,
        } = msg;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let result = ctx.pull(&remote, blocks.blocks(), prompt_len).await;
            if let Err(e) = &result {
                tracing::warn!(request = %id, transfer = %remote.transfer_id, error = %e, "KV pull failed");
            }
            // The destination blocks stay shared until here: no reuse while bytes may land.
            drop(blocks);
            let _ = scheduler.cast(SchedulerMsg::RemoteKvDone {
                id,
                first_token: remote.first_token,
                result,
            });
        });
        Ok(())
    }
}
