//! Starting and stopping one serving instance (role `colocated`): the supervision tree of
//! DESIGN.md behind an OpenAI-compatible HTTP API. `pdserve serve` and the tests use this.

use crate::http::AppState;
use crate::mailbox::Mailbox;
use crate::scheduler::{SchedulerConfig, SchedulerMsg, SchedulerStats};
use crate::supervisor::{InstanceArgs, InstanceSupervisor, SupervisorMsg};
use crate::worker::WorkerSpec;
use pdserve_gpu::loader::LoadedModel;
use pdserve_gpu::tp::TpOptions;
use pdserve_gpu::weights::WeightFormat;
use pdserve_runtime::config::ServeConfig;
use pdserve_runtime::memory::{AnonAllocator, HostMemoryAllocator};
use pdserve_runtime::supervision::{ActorSnapshot, RestartPolicy};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

/// How to start an instance.
pub struct InstanceOptions {
    /// Instance name (prefix of actor names; unique per process).
    pub name: String,
    /// The model.
    pub model: LoadedModel,
    /// Name the API serves the model under (default: the model's own).
    pub served_name: Option<String>,
    /// TP ranks.
    pub tp: usize,
    /// Weight format.
    pub weights: WeightFormat,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens per step.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool (None: from `kv_cache_bytes`).
    pub num_blocks: Option<usize>,
    /// KV memory budget over all ranks when `num_blocks` is not given.
    pub kv_cache_bytes: usize,
    /// Fraction of blocks kept free at admission.
    pub watermark: f64,
    /// Longest sequence (None: the model's context).
    pub max_model_len: Option<usize>,
    /// Where the API listens (None: no HTTP frontend).
    pub bind: Option<SocketAddr>,
    /// Admission bound.
    pub max_concurrent_requests: usize,
    /// Per-request deadline.
    pub request_timeout: Duration,
    /// Bearer token required by the API.
    pub api_key: Option<String>,
    /// Worker restart budget.
    pub restart_policy: RestartPolicy,
    /// Where KV regions come from (ignored when `transfer` is set: the engine's allocator is
    /// used, so a peer can reach them).
    pub alloc: Arc<dyn HostMemoryAllocator>,
    /// The transfer engine for KV hand-off (prefill and decode roles).
    pub transfer: Option<pdserve_transport::TransferConfig>,
    /// How long held KV waits for a decode instance to read and release it.
    pub kv_lease: Duration,
    /// How this instance, as decode, gets a prompt's KV when it drives the hand-off.
    pub transfer_mode: crate::kv_receiver::TransferMode,
    /// As decode: prompts shorter than this are prefilled here (conditional disaggregation).
    pub min_remote_prompt_tokens: usize,
    /// Bound on each step of a KV hand-off (handshake, connect, a batch, a lease call).
    pub kv_timeout: Duration,
    /// Test-only fault injection (`[faults]`).
    pub faults: Option<Arc<pdserve_runtime::faults::FaultInjector>>,
    /// The control plane (`pdserve inspect`, registration with a proxy); `None`: no control
    /// endpoint.
    pub control: Option<crate::control_plane::InstanceControl>,
}

impl InstanceOptions {
    /// Options from a loaded [`ServeConfig`].
    ///
    /// # Errors
    /// When the host/port or weight format in the config do not parse.
    pub fn from_config(cfg: &ServeConfig, model: LoadedModel) -> Result<Self, String> {
        let bind: SocketAddr = format!("{}:{}", cfg.server.host, cfg.server.port)
            .parse()
            .map_err(|e| format!("server.host/server.port: {e}"))?;
        Ok(Self {
            name: cfg.instance.name.clone(),
            model,
            served_name: cfg.model.name.clone(),
            tp: cfg.model.tp,
            weights: cfg
                .model
                .weights
                .parse()
                .map_err(|e| format!("model.weights: {e}"))?,
            max_num_seqs: cfg.scheduler.max_num_seqs,
            max_num_batched_tokens: cfg.scheduler.max_num_batched_tokens,
            block_size: cfg.scheduler.block_size,
            num_blocks: cfg.scheduler.num_blocks,
            kv_cache_bytes: cfg.scheduler.kv_cache_bytes as usize,
            watermark: cfg.scheduler.watermark,
            max_model_len: cfg.scheduler.max_model_len,
            bind: Some(bind),
            max_concurrent_requests: cfg.server.max_concurrent_requests,
            request_timeout: Duration::from_secs(cfg.server.request_timeout_s),
            api_key: cfg.server.api_key.clone(),
            restart_policy: RestartPolicy::default(),
            alloc: Arc::new(AnonAllocator),
            transfer: transfer_config(cfg)?,
            kv_lease: Duration::from_secs(cfg.transfer.kv_lease_s),
            transfer_mode: cfg.transfer.mode.parse()?,
            min_remote_prompt_tokens: cfg.transfer.min_remote_prompt_tokens,
            kv_timeout: Duration::from_secs(cfg.transfer.timeout_s),
            faults: pdserve_runtime::faults::FaultInjector::new(&cfg.faults),
            control: crate::control_plane::InstanceControl::from_config(cfg)?,
        })
    }

    /// Defaults for tests and embedding: 127.0.0.1 on a free port, small pool.
    pub fn local(name: &str, model: LoadedModel) -> Self {
        Self {
            name: name.to_string(),
            model,
            served_name: None,
            tp: 1,
            weights: WeightFormat::Auto,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            block_size: 16,
            num_blocks: Some(256),
            kv_cache_bytes: 0,
            watermark: 0.01,
            max_model_len: None,
            bind: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            max_concurrent_requests: 256,
            request_timeout: Duration::from_secs(120),
            api_key: None,
            restart_policy: RestartPolicy::default(),
            alloc: Arc::new(AnonAllocator),
            transfer: None,
            kv_lease: Duration::from_secs(30),
            transfer_mode: crate::kv_receiver::TransferMode::Pull,
            min_remote_prompt_tokens: 0,
            kv_timeout: Duration::from_secs(30),
            faults: None,
            control: None,
        }
    }
}

/// The transfer engine of a `prefill` or `decode` instance (none for `colocated`).
fn transfer_config(cfg: &ServeConfig) -> Result<Option<pdserve_transport::TransferConfig>, String> {
    use pdserve_runtime::config::InstanceRole;
    if cfg.instance.role == InstanceRole::Colocated {
        return Ok(None);
    }
    let backend: pdserve_transport::BackendKind = cfg
        .transfer
        .backend
        .parse()
        .map_err(|e| format!("transfer.backend: {e}"))?;
    let mut t = pdserve_transport::TransferConfig::new(backend, cfg.instance.name.clone());
    t.listen = cfg
        .transfer
        .listen
        .parse()
        .map_err(|e| format!("transfer.listen: {e}"))?;
    if let Some(dir) = &cfg.transfer.credentials_dir {
        let creds = pdserve_transport::control::tls::MemberCredentials::load(
            std::path::Path::new(dir),
            &cfg.instance.name,
        )
        .map_err(|e| format!("transfer.credentials_dir: {e}"))?;
        t.credentials = Some(creds);
    }
    t.validate().map_err(|e| format!("[transfer]: {e}"))?;
    Ok(Some(t))
}

/// A running instance.
pub struct Instance {
    supervisor: Mailbox<SupervisorMsg>,
    join: tokio::task::JoinHandle<()>,
    scheduler: Mailbox<SchedulerMsg>,
    addr: Option<SocketAddr>,
    model_name: String,
    control: Option<crate::control_plane::ControlPlane>,
    kv: Option<Arc<crate::kv_receiver::KvContext>>,
}

impl Instance {
    /// Starts the supervision tree; returns once every rank is loaded and the API listens.
    ///
    /// # Errors
    /// Model sharding, memory, or bind failures, with the failing actor's message.
    pub async fn start(opts: InstanceOptions) -> Result<Self, String> {
        let model = opts.model;
        let cfg = model.config.clone();
        cfg.check_tp(opts.tp).map_err(|e| e.to_string())?;
        let bytes_per_block_all_ranks =
            2 * cfg.num_layers * cfg.num_kv_heads * opts.block_size * cfg.head_dim * 4;
        let num_blocks = opts
            .num_blocks
            .unwrap_or(opts.kv_cache_bytes / bytes_per_block_all_ranks)
            .max(1);
        let max_model_len = opts
            .max_model_len
            .unwrap_or(cfg.context_length)
            .min(cfg.context_length);
        let served = opts.served_name.unwrap_or_else(|| model.name.clone());
        let worker = WorkerSpec {
            config: cfg.clone(),
            store: Arc::new(model.store),
            opts: TpOptions {
                tp: opts.tp,
                num_blocks,
                block_size: opts.block_size,
                format: opts.weights,
            },
            alloc: opts.alloc,
            faults: opts.faults.clone(),
        };
        let tokenizer = model.tokenizer.clone();
        let kv = match opts.transfer {
            Some(tcfg) => {
                let engine = pdserve_transport::TransferEngine::new(tcfg)
                    .map_err(|e| format!("transfer engine: {e}"))?;
                let registry = crate::kv_receiver::KvRegistry::new(
                    Arc::new(engine),
                    opts.tp,
                    opts.faults.clone(),
                );
                let mut ctx = crate::kv_receiver::KvContext::new(
                    opts.name.clone(),
                    registry,
                    cfg.clone(),
                    opts.tp,
                    num_blocks,
                    opts.block_size,
                    opts.kv_timeout,
                );
                ctx.faults = opts.faults.clone();
                ctx.mode = opts.transfer_mode;
                ctx.min_remote_prompt_tokens = opts.min_remote_prompt_tokens;
                ctx.lease = opts.kv_lease;
                ctx.prefill_timeout = opts.request_timeout;
                ctx.api_key = opts.api_key.clone();
                Some(Arc::new(ctx))
            }
            None => None,
        };
        let kv_for_http = kv.clone();
        let kv_for_figures = kv.clone();
        let kv_for_control = kv.clone();
        let http = opts.bind.map(|bind| {
            let (tokenizer, chat_template, model_name) = (
                model.tokenizer.clone(),
                model.chat_template.clone(),
                served.clone(),
            );
            let (max_concurrent, timeout, api_key) = (
                opts.max_concurrent_requests,
                opts.request_timeout,
                opts.api_key.clone(),
            );
            let vocab_size = cfg.vocab_size;
            let make = move |scheduler: Mailbox<SchedulerMsg>, kv_sender| AppState {
                scheduler,
                kv_sender,
                tokenizer,
                chat_template,
                model_name,
                max_model_len,
                vocab_size,
                admission: Arc::new(tokio::sync::Semaphore::new(max_concurrent)),
                request_timeout: timeout,
                api_key,
                next_id: AtomicU64::new(1),
                metrics: pdserve_runtime::telemetry::install_metrics(),
                kv: kv_for_http,
                aborted: Default::default(),
                addr: std::sync::OnceLock::new(),
            };
            (bind, Box::new(make) as crate::supervisor::AppStateFactory)
        });
        let args = InstanceArgs {
            name: opts.name.clone(),
            worker,
            scheduler: SchedulerConfig {
                max_num_seqs: opts.max_num_seqs,
                max_num_batched_tokens: opts.max_num_batched_tokens,
                block_size: opts.block_size,
                num_blocks,
                watermark_blocks: (num_blocks as f64 * opts.watermark) as usize,
                max_model_len,
                kv_lease: opts.kv_lease,
            },
            tokenizer,
            http,
            restart_policy: opts.restart_policy,
            kv,
        };
        let (supervisor, join) = Mailbox::spawn(
            Some(format!("{}/supervisor", opts.name)),
            InstanceSupervisor,
            args,
        )
        .await
        .map_err(|e| format!("instance {} failed to start: {e}", opts.name))?;
        let (scheduler, addr) = ractor::call_t!(supervisor, SupervisorMsg::Handles, 5_000)
            .map_err(|e| e.to_string())?;
        let control = match opts.control {
            Some(ctl) => {
                let source = crate::control_plane::InspectSource {
                    name: opts.name.clone(),
                    role: ctl.role,
                    model: served.clone(),
                    tp: opts.tp,
                    supervisor: supervisor.clone(),
                    scheduler: scheduler.clone(),
                    kv: kv_for_control,
                };
                let url = addr.map(|a| format!("http://{a}"));
                match crate::control_plane::ControlPlane::start(ctl, source, url) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        supervisor.stop(Some("control plane failed".into()));
                        let _ = tokio::time::timeout(Duration::from_secs(10), join).await;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        Ok(Self {
            supervisor,
            join,
            scheduler,
            addr,
            model_name: served,
            control,
            kv: kv_for_figures,
        })
    }

    /// KV hand-off figures (instances with a transfer engine).
    pub fn kv_figures(&self) -> Option<crate::kv_receiver::KvFigures> {
        self.kv.as_ref().map(|k| k.figures())
    }

    /// The API address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// `http://host:port` of the API.
    pub fn url(&self) -> String {
        self.addr.map(|a| format!("http://{a}")).unwrap_or_default()
    }

    /// The control plane, when the instance has cluster credentials.
    pub fn control_plane(&self) -> Option<&crate::control_plane::ControlPlane> {
        self.control.as_ref()
    }

    /// The served model name.
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The scheduler, for in-process clients.
    pub fn scheduler(&self) -> &Mailbox<SchedulerMsg> {
        &self.scheduler
    }

    /// Queue and pool figures.
    ///
    /// # Errors
    /// When the scheduler is gone or slow.
    pub async fn stats(&self) -> Result<SchedulerStats, String> {
        crate::supervisor::scheduler_stats(&self.scheduler)
            .await
            .map_err(|e| e.to_string())
    }

    /// The live actor tree.
    ///
    /// # Errors
    /// When the supervisor is gone or slow.
    pub async fn snapshot(&self) -> Result<ActorSnapshot, String> {
        ractor::call_t!(self.supervisor, SupervisorMsg::Snapshot, 5_000).map_err(|e| e.to_string())
    }

    /// Submits a request from inside the process (no HTTP): its events arrive on the returned
    /// channel; dropping the receiver aborts it.
    ///
    /// # Errors
    /// When the scheduler is gone.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: pdserve_gpu::sampling::SamplingParams,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<crate::scheduler::RequestEvent>, String> {
        static NEXT: AtomicU64 = AtomicU64::new(1 << 48);
        let id = pdserve_runtime::ids::RequestId(
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        );
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let request = crate::scheduler::NewRequest {
            id,
            prompt,
            params,
            hold_for: None,
            push: false,
        };
        self.scheduler
            .cast(SchedulerMsg::Submit { request, sink: tx })
            .map_err(|e| e.to_string())?;
        Ok(rx)
    }

    /// Test-only fault hook: the actor of `kind` (for `TpWorker`, of rank `rank`) panics as
    /// it takes its next message; its supervisor then acts on the failure.
    ///
    /// # Errors
    /// When the instance has no such actor, or its supervisor is gone.
    pub async fn inject_panic(&self, kind: &str, rank: usize) -> Result<(), String> {
        let kind = kind.to_string();
        let found = ractor::call_t!(
            self.supervisor,
            SupervisorMsg::InjectPanic,
            5_000,
            kind.clone(),
            rank
        )
        .map_err(|e| e.to_string())?;
        if found {
            Ok(())
        } else {
            Err(format!("instance has no {kind} actor (rank {rank})"))
        }
    }

    /// Whether the supervision tree is still running.
    pub fn is_running(&self) -> bool {
        !self.join.is_finished()
    }

    /// Stops the instance and waits for it (bounded).
    pub async fn stop(self) {
        // Leave the cluster first: the proxy stops routing here at once.
        if let Some(control) = &self.control {
            control.shutdown();
        }
        self.supervisor.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(10), self.join).await;
    }

    /// Resolves when the supervision tree has stopped by itself (an escalated failure).
    pub async fn stopped(&mut self) {
        let _ = (&mut self.join).await;
    }
}
