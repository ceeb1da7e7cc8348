//! The decode side's KV hand-off: the KvReceiver actor, the registry of this instance's KV
//! regions in its transfer engine, and the [`KvContext`] both hand-off actors share.
//!
//! A request that arrives with `kv_transfer_params.do_remote_prefill` gets its destination
//! blocks from the Scheduler (state `WaitingForRemoteKv`) and a `Fetch` here, in one of two
//! shapes ([`KvSource`]):
//! - **held** (vLLM's two-hop proxy): the prefill instance already ran the prompt and holds
//!   its blocks; the parameters name them and T0;
//! - **drive** (pdserve's proxy, one hop): we ask the prefill instance to run the prompt
//!   (`POST /v1/kv/prefill`) in our configured [`TransferMode`]: *pull* gets the held block
//!   ids back, *push* sends our destination blocks along and the prefill side writes them
//!   layer by layer, answering with T0 once its last write finished.
//!
//! Pulling fetches and validates the prefill instance's published KV layout (the handshake,
//! cached per peer), opens a transfer session (cached per peer), reads every (layer, K/V,
//! block, head range) the request owns — one batch per local TP rank, joined by the
//! Aggregator — while renewing the prefill side's lease (batched per peer), then releases
//! it. The release answer says whether the lease was still alive: if it had expired, the
//! blocks may have been reused while we read, and the request fails loudly instead of
//! decoding from garbage. The receiver keeps a share of the destination blocks until no byte
//! can land any more, so an abort never lets them be reused under a transfer: an aborted
//! push waits for the prefill side's answer, which comes after its writes drained. Each
//! hand-off runs on a task; the mailbox never waits.
//!
//! Supervised by the `InstanceSupervisor`, which restarts it. Hand-off tasks and their
//! cancel handles live in the [`KvContext`], not in the actor, so a restart loses none:
//! an abort reaches a hand-off whichever incarnation started it.

use crate::aggregator::{AggregatorMsg, RankReport};
use crate::block_manager::BlockAllocation;
use crate::kv_transfer::{compat_hash, compat_key, plan_pull, validate_peer, KvPeerInfo, RankKv};
use crate::mailbox::{Inbox, Mailbox};
use crate::scheduler::SchedulerMsg;
use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::kv::{KvDtype, KvLayout};
use pdserve_gpu::sampling::SamplingParams;
use pdserve_runtime::faults::{ControlFault, Fault, FaultInjector, TransferFault};
use pdserve_runtime::ids::{RequestId, TransferId};
use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_transport::{RegisteredRegion, Session, TransferEngine, TransferOp};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// This instance's KV regions, registered with its transfer engine, per TP rank.
pub struct KvRegistry {
    engine: Arc<TransferEngine>,
    ranks: Mutex<Vec<Vec<RegisteredRegion>>>,
    faults: Option<Arc<FaultInjector>>,
    generation: AtomicU64,
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
            generation: AtomicU64::new(0),
        })
    }

    /// Bumped whenever a rank's cache is replaced (a restarted worker): KV that landed in
    /// regions of an older generation is gone.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
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
            if !ranks[self.rank].is_empty() {
                self.registry.generation.fetch_add(1, Ordering::SeqCst);
            }
            ranks[self.rank].clear();
        }
        ranks[self.rank].push(region);
        Ok(mem)
    }
}

/// How KV moves from prefill to decode when the decode instance drives the hand-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransferMode {
    /// vLLM NIXL style: prefill finishes and holds the blocks under a lease; decode reads
    /// them and releases the lease.
    #[default]
    Pull,
    /// Mooncake/SGLang style: decode sends its destination blocks with the prompt; prefill
    /// writes each layer's blocks as soon as that layer is computed.
    Push,
}

impl std::str::FromStr for TransferMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pull" => Ok(Self::Pull),
            "push" => Ok(Self::Push),
            other => Err(format!(
                "unknown transfer mode `{other}` (expected push or pull)"
            )),
        }
    }
}

impl TransferMode {
    /// `push` or `pull`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pull => "pull",
            Self::Push => "push",
        }
    }
}

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
    /// Bound on a remote prefill this instance asked for (the prompt's whole forward pass).
    pub prefill_timeout: Duration,
    /// How this instance, as decode, asks for a prompt's KV when it drives the hand-off.
    pub mode: TransferMode,
    /// As decode: prompts shorter than this are prefilled here instead of remotely
    /// (conditional disaggregation); 0 disaggregates every prompt.
    pub min_remote_prompt_tokens: usize,
    /// As prefill: how long held blocks wait for the reader (published with them).
    pub lease: Duration,
    /// Hand-offs in progress.
    pub in_flight: AtomicU64,
    /// Bytes written to peers.
    pub bytes_sent: AtomicU64,
    /// Bytes read from peers.
    pub bytes_received: AtomicU64,
    /// Failed hand-offs.
    pub failures: AtomicU64,
    /// Test-only fault injection at the transfer and control-message points.
    pub faults: Option<Arc<FaultInjector>>,
    /// The cluster's API key, sent on our calls to peers' `/v1/kv/*` (this instance's own
    /// `server.api_key`: a cluster shares one).
    pub api_key: Option<String>,
    http: reqwest::Client,
    peers: tokio::sync::Mutex<HashMap<String, KvPeerInfo>>,
    sessions: tokio::sync::Mutex<HashMap<String, Arc<Session>>>,
    renewals: Mutex<HashMap<String, HashMap<TransferId, usize>>>,
    handoffs: Mutex<HashMap<RequestId, CancellationToken>>,
    /// Set when a KvSender failed with pushes open: their writes may land until then.
    pub(crate) orphan_writes_until: Mutex<Option<std::time::Instant>>,
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
            prefill_timeout: Duration::from_secs(120),
            mode: TransferMode::Pull,
            min_remote_prompt_tokens: 0,
            lease: Duration::from_secs(30),
            in_flight: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            faults: None,
            api_key: None,
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .unwrap_or_default(),
            peers: tokio::sync::Mutex::new(HashMap::new()),
            sessions: tokio::sync::Mutex::new(HashMap::new()),
            renewals: Mutex::new(HashMap::new()),
            handoffs: Mutex::new(HashMap::new()),
            orphan_writes_until: Mutex::new(None),
        }
    }

    /// Hand-off figures so far.
    pub fn figures(&self) -> KvFigures {
        KvFigures {
            transfers_in_flight: self.in_flight.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
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

    /// The handshake with a peer: its published KV memory, fetched once and validated
    /// against ours (cached per peer URL).
    async fn peer_info(&self, url: &str) -> Result<KvPeerInfo, String> {
        if let Some(p) = self.peers.lock().await.get(url) {
            return Ok(p.clone());
        }
        let info: KvPeerInfo = self
            .authed(self.http.get(format!("{url}/v1/kv/info")))
            .timeout(self.timeout)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("cannot fetch the KV layout of {url}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("bad KV layout from {url}: {e}"))?;
        validate_peer(&self.info(), &info).map_err(|e| e.to_string())?;
        metrics::counter!(pdserve_runtime::telemetry::KV_HANDSHAKES_TOTAL).increment(1);
        self.peers
            .lock()
            .await
            .insert(url.to_string(), info.clone());
        Ok(info)
    }

    /// Forgets what the handshake with `url` learned (after a failed hand-off: the peer may
    /// have restarted a worker and registered new regions, or restarted altogether).
    async fn forget_peer(&self, url: &str) {
        self.peers.lock().await.remove(url);
    }

    /// A transfer session to `peer`'s engine (cached per address), whose view of the peer's
    /// regions covers every region the peer published (a restarted peer worker registers
    /// new ones).
    pub(crate) async fn session_for(&self, peer: &KvPeerInfo) -> Result<Arc<Session>, String> {
        let addr = &peer.transfer_addr;
        let session = {
            let mut sessions = self.sessions.lock().await;
            match sessions.get(addr).filter(|s| s.is_alive()) {
                Some(s) => s.clone(),
                None => {
                    let s = tokio::time::timeout(self.timeout, self.registry.engine.connect(addr))
                        .await
                        .map_err(|_| format!("connecting to {addr} timed out"))?
                        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
                    let s = Arc::new(s);
                    sessions.insert(addr.to_string(), s.clone());
                    s
                }
            }
        };
        let known: std::collections::HashSet<u64> =
            session.remote_regions().iter().map(|r| r.id).collect();
        if peer
            .ranks
            .iter()
            .flat_map(|r| &r.regions)
            .any(|id| !known.contains(id))
        {
            tokio::time::timeout(self.timeout, session.refresh_regions())
                .await
                .map_err(|_| format!("refreshing the regions of {addr} timed out"))?
                .map_err(|e| e.to_string())?;
        }
        Ok(session)
    }

    /// Reads a request's prompt KV from a prefill instance into `local_blocks` — one batch per
    /// local TP rank, joined by the Aggregator — then releases the prefill side's lease. The
    /// lease is renewed (batched per peer) while the reads run.
    ///
    /// # Errors
    /// Layout mismatches, forged block ids, transfer failures and expired leases, as text.
    pub async fn pull(
        self: &Arc<Self>,
        remote: &RemotePrefill,
        local_blocks: &[u32],
        prompt_len: usize,
        aggregator: &Mailbox<AggregatorMsg>,
    ) -> Result<(), String> {
        let theirs = self.peer_info(&remote.url).await?;
        let per_rank = plan_pull(
            &self.info(),
            &theirs,
            local_blocks,
            &remote.block_ids,
            prompt_len,
        )
        .map_err(|e| e.to_string())?;
        let _renewing = self.renew_while_alive(&remote.url, remote.transfer_id, remote.lease);
        let session = self.session_for(&theirs).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        aggregator
            .cast(AggregatorMsg::Expect {
                transfer: remote.transfer_id,
                epochs: vec![0; per_rank.len()],
                done: tx,
            })
            .map_err(|_| "the aggregator is gone".to_string())?;
        // Every batch is awaited to its end, even after one failed: our blocks may not be
        // released while a read can still land in them.
        let reads = per_rank.iter().enumerate().map(|(rank, ops)| {
            let session = session.clone();
            async move {
                let mut ops = ops.clone();
                let faulted = self.transfer_fault(&mut ops).await;
                let report = match faulted.and_then(|()| {
                    session
                        .submit(&ops)
                        .map_err(|e| format!("KV transfer refused: {e}"))
                }) {
                    Ok(batch) => match batch.wait(self.timeout).await {
                        Ok(()) => {
                            self.bytes_received
                                .fetch_add(batch.bytes(), Ordering::Relaxed);
                            metrics::counter!(pdserve_runtime::telemetry::KV_TRANSFER_BYTES_TOTAL, pdserve_runtime::telemetry::LABEL_DIRECTION => "received").increment(batch.bytes());
                            RankReport::Done
                        }
                        Err(e) => RankReport::Failed(format!("KV transfer failed: {e}")),
                    },
                    Err(e) => RankReport::Failed(e),
                };
                let _ = aggregator.cast(AggregatorMsg::Report {
                    transfer: remote.transfer_id,
                    rank,
                    epoch: 0,
                    report,
                });
            }
        });
        futures_util::future::join_all(reads).await;
        // Without an outcome (the Aggregator failed or is stuck) the hand-off failed too,
        // and the prefill side is still told to free its blocks.
        let outcome = match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the aggregator failed during the hand-off".to_string()),
            Err(_) => Err("the aggregator did not answer".to_string()),
        };
        if let Err(e) = outcome {
            let _ = aggregator.cast(AggregatorMsg::Forget(remote.transfer_id));
            // Best effort: the prefill side frees the blocks now instead of at lease expiry.
            let _ = self.release(&remote.url, remote.transfer_id).await;
            return Err(e);
        }
        self.release(&remote.url, remote.transfer_id).await
    }

    async fn release(&self, url: &str, transfer: TransferId) -> Result<(), String> {
        let released = self
            .control(
                format!("{url}/v1/kv/release"),
                serde_json::json!({"transfer_id": transfer.to_string()}),
                self.timeout,
            )
            .await
            .map_err(|e| format!("cannot release the KV lease at {url}: {e}"))?;
        match released.status().as_u16() {
            200 => Ok(()),
            410 => Err(format!("the KV lease of transfer {transfer} expired (or was aborted) before the read finished: its blocks may have been reused")),
            s => Err(format!("releasing transfer {transfer} failed with HTTP {s}")),
        }
    }

    /// Sends one instance-to-instance control call (bounded by `timeout`), through the
    /// fault injector when one is configured: a dropped call is not sent and fails after
    /// `timeout`, as a lost one would; a corrupted one carries a body that does not parse.
    async fn control(
        &self,
        url: String,
        body: serde_json::Value,
        timeout: Duration,
    ) -> Result<reqwest::Response, String> {
        let mut bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
        match self
            .faults
            .as_ref()
            .map_or(ControlFault::Send, |f| f.control())
        {
            ControlFault::Send => {}
            ControlFault::Drop => {
                tokio::time::sleep(timeout).await;
                return Err(format!(
                    "{url}: timed out after {} s (injected fault: the message was dropped)",
                    timeout.as_secs()
                ));
            }
            ControlFault::Delay(d) => tokio::time::sleep(d).await,
            ControlFault::Corrupt => bytes = b"\x00{injected fault: corrupted".to_vec(),
        }
        self.authed(self.http.post(url))
            .timeout(timeout)
            .header("content-type", "application/json")
            .body(bytes)
            .send()
            .await
            .map_err(|e| error_chain(&e))
    }

    fn authed(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    /// Applies an injected transfer fault to a batch about to be submitted: fails it, delays
    /// it, or points one span outside its region (the engine must refuse it).
    ///
    /// # Errors
    /// The injected failure.
    pub(crate) async fn transfer_fault(&self, ops: &mut [TransferOp]) -> Result<(), String> {
        match self
            .faults
            .as_ref()
            .map_or(TransferFault::Submit, |f| f.transfer())
        {
            TransferFault::Submit => Ok(()),
            TransferFault::Fail => Err("injected fault: the KV transfer failed".into()),
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
        }
    }

    /// Asks the prefill instance at `url` to drop a hand-off (abort its prefill, stop its
    /// writes, free held blocks); it answers once none of its writes is in flight. Bounded.
    /// An unreachable peer is taken for dead (its writes died with it).
    /// Returns whether the prefill side confirmed that none of its writes is in flight.
    async fn abort_remote(&self, url: &str, transfer: TransferId) -> bool {
        let r = self
            .control(
                format!("{url}/v1/kv/abort"),
                serde_json::json!({"transfer_id": transfer.to_string()}),
                self.timeout,
            )
            .await;
        match r {
            Ok(r) if r.status().is_success() => r
                .json::<serde_json::Value>()
                .await
                .is_ok_and(|v| v["drained"] == true),
            Ok(r) => {
                tracing::info!(%transfer, %url, status = %r.status(), "the prefill instance refused the abort");
                false
            }
            Err(e) => {
                tracing::info!(%transfer, %url, error = %e, "the prefill instance did not answer the abort");
                false
            }
        }
    }

    /// After a push whose writer never confirmed it stopped: keep the destination blocks out
    /// of the pool for one more transfer bound. A writer that saw its hand-off cancelled
    /// submits nothing new, and each write it has in flight ends within that bound.
    async fn quarantine(&self, url: &str, transfer: TransferId) {
        tracing::warn!(%transfer, %url, secs = self.timeout.as_secs(), "no word from the prefill instance on its writes: holding the destination blocks before reuse");
        tokio::time::sleep(self.timeout).await;
    }

    /// Runs the prompt on the prefill instance at `url` and brings its KV into
    /// `local_blocks` (decode drives the hand-off). Returns the first token (T0).
    ///
    /// Pull: the prefill instance holds the blocks and answers their ids; we read them.
    /// Push: we send our destination blocks with the prompt; the prefill instance writes
    /// them layer by layer and answers once its last write finished. An abort (`cancel`)
    /// tells the prefill side to stop and still waits for its answer, so no write lands in
    /// our blocks after they are released.
    ///
    /// # Errors
    /// The prefill instance's refusal, transfer failures, timeouts and aborts, as text.
    #[allow(clippy::too_many_arguments)]
    pub async fn drive(
        self: &Arc<Self>,
        url: &str,
        transfer: TransferId,
        prompt: &[u32],
        params: &SamplingParams,
        local_blocks: &[u32],
        cancel: &CancellationToken,
        aggregator: &Mailbox<AggregatorMsg>,
    ) -> Result<u32, String> {
        let mut sampling = params.clone();
        sampling.max_tokens = 1;
        let mut body = serde_json::json!({
            "transfer_id": transfer.to_string(),
            "prompt_token_ids": prompt,
            "sampling": sampling,
            "mode": self.mode.as_str(),
        });
        if self.mode == TransferMode::Push {
            // The handshake: the peer's layout is validated against ours before it may write.
            self.peer_info(url).await?;
            let n = prompt.len().div_ceil(self.block_size);
            if local_blocks.len() < n {
                return Err(format!(
                    "{} tokens need {n} destination blocks, the request owns {}",
                    prompt.len(),
                    local_blocks.len()
                ));
            }
            body["target"] = serde_json::json!({
                "peer": self.info(),
                "block_ids": &local_blocks[..n],
            });
        }
        let call = self.control(format!("{url}/v1/kv/prefill"), body, self.prefill_timeout);
        tokio::pin!(call);
        let resp = tokio::select! {
            r = &mut call => r,
            () = cancel.cancelled() => {
                let confirmed = self.abort_remote(url, transfer).await;
                if self.mode == TransferMode::Push && !confirmed {
                    // The prefill side answers the call once its writes have drained.
                    let answered = matches!(
                        tokio::time::timeout(self.prefill_timeout, &mut call).await,
                        Ok(Ok(_))
                    );
                    if !answered {
                        self.quarantine(url, transfer).await;
                    }
                }
                return Err("aborted".into());
            }
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                // No answer: the prefill side may still be writing. It stops and drains on
                // the abort (or is dead) before our blocks may go back to the pool.
                if self.mode == TransferMode::Push && !self.abort_remote(url, transfer).await {
                    self.quarantine(url, transfer).await;
                }
                return Err(format!("remote prefill at {url}: {e}"));
            }
        };
        let status = resp.status();
        let answer: serde_json::Value = resp
            .json()
            .await
            .map_err(|e| format!("remote prefill at {url}: bad answer: {e}"))?;
        if !status.is_success() {
            let msg = answer["error"]["message"].as_str().unwrap_or("no message");
            return Err(format!("remote prefill at {url} failed ({status}): {msg}"));
        }
        let first_token = answer["first_token_id"]
            .as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .filter(|&t| (t as usize) < self.model.vocab_size)
            .ok_or_else(|| {
                format!("remote prefill at {url}: no valid first_token_id in {answer}")
            })?;
        if self.mode == TransferMode::Push {
            return Ok(first_token);
        }
        let block_ids = answer["block_ids"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| format!("remote prefill at {url}: no block_ids in {answer}"))?;
        let remote = RemotePrefill {
            transfer_id: transfer,
            url: url.to_string(),
            block_ids,
            first_token,
            lease: answer["kv_lease_ms"].as_u64().map(Duration::from_millis),
        };
        // Reads are not cut short by an abort: our blocks may not be released while a read
        // can still land in them. The pull is bounded by the transfer timeout.
        self.pull(&remote, local_blocks, prompt.len(), aggregator)
            .await?;
        if cancel.is_cancelled() {
            return Err("aborted".into());
        }
        Ok(first_token)
    }

    /// Keeps renewing `transfer`'s lease at the prefill instance `url` until the returned
    /// guard drops. Renewals are batched per peer: one task per peer sends one request with
    /// every transfer being read from it, every third of the lease; it ends when none is left.
    fn renew_while_alive(
        self: &Arc<Self>,
        url: &str,
        transfer: TransferId,
        lease: Option<Duration>,
    ) -> RenewGuard {
        let mut all = self.renewals.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains_key(url) {
            let (ctx, url) = (self.clone(), url.to_string());
            let interval = (lease.unwrap_or(self.lease) / 3).max(Duration::from_millis(50));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(interval).await;
                    {
                        let mut all = ctx.renewals.lock().unwrap_or_else(|e| e.into_inner());
                        if all.get(&url).is_none_or(HashMap::is_empty) {
                            all.remove(&url);
                            return;
                        }
                    }
                    ctx.renew(&url).await;
                }
            });
        }
        *all.entry(url.to_string())
            .or_default()
            .entry(transfer)
            .or_default() += 1;
        RenewGuard {
            ctx: self.clone(),
            url: url.to_string(),
            transfer,
        }
    }

    fn renewing(&self, url: &str) -> Vec<TransferId> {
        let all = self.renewals.lock().unwrap_or_else(|e| e.into_inner());
        all.get(url)
            .map(|p| p.keys().copied().collect())
            .unwrap_or_default()
    }

    /// One batched renewal of every lease held for us at `url`.
    async fn renew(&self, url: &str) {
        let ids: Vec<String> = self.renewing(url).iter().map(|t| t.to_string()).collect();
        if ids.is_empty() {
            return;
        }
        let r = self
            .control(
                format!("{url}/v1/kv/renew"),
                serde_json::json!({"transfer_ids": ids}),
                self.timeout,
            )
            .await;
        if let Err(e) = r {
            tracing::debug!(%url, error = %e, "lease renewal failed");
        }
    }
}

/// An error with its causes (`reqwest` prints only the outermost: "error sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// One transfer's registration with its peer's renewal task; dropping it stops renewing
/// that transfer.
struct RenewGuard {
    ctx: Arc<KvContext>,
    url: String,
    transfer: TransferId,
}

impl Drop for RenewGuard {
    fn drop(&mut self) {
        let mut all = self.ctx.renewals.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(peer) = all.get_mut(&self.url) {
            if let Some(n) = peer.get_mut(&self.transfer) {
                *n -= 1;
                if *n == 0 {
                    peer.remove(&self.transfer);
                }
            }
        }
    }
}

/// Where a request's prompt KV is, from `kv_transfer_params` with `remote_block_ids`.
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
    /// How long it holds the blocks unless renewed (`kv_lease_ms`), when it said.
    pub lease: Option<Duration>,
}

/// Where a remote request's prompt KV comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvSource {
    /// Already computed and held by a prefill instance (vLLM's two-hop flow).
    Held(RemotePrefill),
    /// To be computed by the prefill instance at `url`, asked by us.
    Drive {
        /// The prefill instance's API.
        url: String,
        /// The hand-off id.
        transfer_id: TransferId,
    },
}

impl KvSource {
    /// The hand-off id.
    pub fn transfer_id(&self) -> TransferId {
        match self {
            Self::Held(r) => r.transfer_id,
            Self::Drive { transfer_id, .. } => *transfer_id,
        }
    }
}

/// One request's hand-off for the KvReceiver.
pub struct Fetch {
    /// Request.
    pub id: RequestId,
    /// Where it comes from.
    pub source: KvSource,
    /// Our destination blocks (a share, kept until no byte can land any more).
    pub blocks: BlockAllocation,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// The request's sampling (the prefill side samples T0 with it).
    pub params: SamplingParams,
    /// Where the outcome goes.
    pub reply: FetchReply,
}

/// The Scheduler's end of a hand-off: answered exactly once, by the hand-off or, if the
/// request never got that far (the KvReceiver failed with it in its mailbox), by its drop.
pub struct FetchReply {
    id: RequestId,
    scheduler: Option<Mailbox<SchedulerMsg>>,
}

impl FetchReply {
    /// The reply for request `id`.
    pub fn new(id: RequestId, scheduler: Mailbox<SchedulerMsg>) -> Self {
        Self {
            id,
            scheduler: Some(scheduler),
        }
    }

    fn send(mut self, result: Result<u32, String>, generation: u64) {
        if let Some(s) = self.scheduler.take() {
            let _ = s.cast(SchedulerMsg::RemoteKvDone {
                id: self.id,
                result,
                generation,
            });
        }
    }
}

impl Drop for FetchReply {
    fn drop(&mut self) {
        if let Some(s) = self.scheduler.take() {
            let _ = s.cast(SchedulerMsg::RemoteKvDone {
                id: self.id,
                result: Err("the KV receiver failed before the hand-off started".into()),
                generation: 0,
            });
        }
    }
}

/// Messages of the KvReceiver.
pub enum KvReceiverMsg {
    /// Bring a request's prompt KV into its destination blocks.
    Fetch(Box<Fetch>),
    /// The request was aborted: stop its hand-off (the prefill side is told).
    Abort(RequestId),
}

/// The KvReceiver actor (its mailbox count).
#[derive(Debug)]
pub struct KvReceiver(pub Inbox);

/// Its state.
pub struct ReceiverState {
    kv: Arc<KvContext>,
    aggregator: Mailbox<AggregatorMsg>,
}

impl Actor for KvReceiver {
    type Msg = KvReceiverMsg;
    type State = ReceiverState;
    type Arguments = (Arc<KvContext>, Mailbox<AggregatorMsg>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (kv, aggregator): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ReceiverState { kv, aggregator })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            KvReceiverMsg::Fetch(fetch) => {
                let Fetch {
                    id,
                    source,
                    blocks,
                    prompt,
                    params,
                    reply,
                } = *fetch;
                let cancel = CancellationToken::new();
                st.kv
                    .handoffs
                    .lock()
                    .expect("hand-offs poisoned")
                    .insert(id, cancel.clone());
                let (kv, aggregator) = (st.kv.clone(), st.aggregator.clone());
                kv.in_flight.fetch_add(1, Ordering::Relaxed);
                let started = std::time::Instant::now();
                tokio::spawn(async move {
                    let transfer = source.transfer_id();
                    let generation = kv.registry.generation();
                    let result = match &source {
                        KvSource::Held(remote) => kv
                            .pull(remote, blocks.blocks(), prompt.len(), &aggregator)
                            .await
                            .map(|()| remote.first_token),
                        KvSource::Drive { url, transfer_id } => {
                            kv.drive(
                                url,
                                *transfer_id,
                                &prompt,
                                &params,
                                blocks.blocks(),
                                &cancel,
                                &aggregator,
                            )
                            .await
                        }
                    };
                    kv.in_flight.fetch_sub(1, Ordering::Relaxed);
                    if result.is_err() {
                        let url = match &source {
                            KvSource::Held(r) => &r.url,
                            KvSource::Drive { url, .. } => url,
                        };
                        kv.forget_peer(url).await;
                    }
                    use pdserve_runtime::telemetry as m;
                    match &result {
                        Err(e) => {
                            kv.failures.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(m::KV_TRANSFER_FAILURES_TOTAL, m::LABEL_KIND => m::kv_failure_kind(e)).increment(1);
                            tracing::warn!(request = %id, %transfer, error = %e, "KV hand-off failed");
                        }
                        Ok(_) => {
                            let mode = match &source {
                                KvSource::Held(_) => TransferMode::Pull,
                                KvSource::Drive { .. } => kv.mode,
                            };
                            metrics::histogram!(m::KV_TRANSFER_SECONDS, m::LABEL_MODE => mode.as_str())
                                .record(started.elapsed().as_secs_f64());
                            tracing::info!(request = %id, %transfer, mode = mode.as_str(), ms = started.elapsed().as_millis() as u64, "KV hand-off done");
                        }
                    }
                    // The destination blocks stay shared until here: no reuse while bytes may land.
                    drop(blocks);
                    kv.handoffs.lock().expect("hand-offs poisoned").remove(&id);
                    reply.send(result, generation);
                });
            }
            KvReceiverMsg::Abort(id) => {
                let handoffs = st.kv.handoffs.lock().expect("hand-offs poisoned");
                if let Some(cancel) = handoffs.get(&id) {
                    cancel.cancel();
                }
            }
        }
        Ok(())
    }
}
