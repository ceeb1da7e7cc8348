//! Starting and stopping one serving instance: the supervision tree of the design behind an
//! HTTP API and (with cluster credentials) a control plane. `pdserve serve` and the tests use
//! this.
//!
//! **Shutdown is phased** ([`Instance::stop`]): stop admitting (new requests get 503, `/health`
//! says `stopping`) → leave the proxy's routing set → drain what runs (requests and KV
//! hand-offs, bounded by `server.drain_timeout_s`; what is left is then cut off with clear
//! errors) → stop the actors → close the control plane and the transfer engine. Every
//! hand-off task is tracked, so none outlives the instance; the [`ShutdownReport`] says what
//! was left at each phase and whether the block pool was full at the end.

use crate::control_plane::{ControlPlane, InspectSource, InstanceControl};
use crate::error::{RequestError, StartError};
use crate::handoff::aggregator::Epochs;
use crate::handoff::peer::Peers;
use crate::handoff::protocol::compat_key;
use crate::handoff::pull::PullBounds;
use crate::handoff::service::PromptLimits;
use crate::handoff::{KvContext, KvFigures, KvRegistry, KvSettings, PeerService, TransferMode};
use crate::http::{AppState, HttpTls};
use crate::mailbox::Mailbox;
use crate::scheduler::{
    NewRequest, RequestStream, SchedulerConfig, SchedulerHandle, SchedulerMsg, SchedulerStats,
};
use crate::supervisor::{InstanceArgs, InstanceSupervisor, SupervisorHandle};
use crate::worker::{KvMirror, RankDevice, WorkerSpec};
use pdserve_gpu::kv::KvDtype;
use pdserve_gpu::loader::LoadedModel;
use pdserve_gpu::tp::TpOptions;
use pdserve_gpu::weights::WeightFormat;
use pdserve_runtime::config::ServeConfig;
use pdserve_runtime::memory::{AnonAllocator, HostMemoryAllocator};
use pdserve_runtime::supervision::{ActorSnapshot, RestartPolicy};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to start an instance.
pub struct InstanceOptions {
    /// Instance name (prefix of actor names; unique per process).
    pub name: String,
    /// The model.
    pub model: LoadedModel,
    /// Names the API serves the model under, the first the primary (`model.name`; empty:
    /// the model's own). Requests may name any of them or the model's own name.
    pub served_name: Vec<String>,
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
    /// Element type of the KV cache (`scheduler.kv_cache_dtype`).
    pub kv_dtype: KvDtype,
    /// Fraction of blocks kept free at admission.
    pub watermark: f64,
    /// Longest sequence (None: the model's context).
    pub max_model_len: Option<usize>,
    /// Where the API listens (None: no HTTP frontend).
    pub bind: Option<SocketAddr>,
    /// Admission bound: requests in flight (running and waiting) past which new ones get 503.
    pub max_concurrent_requests: usize,
    /// Messages waiting for the Scheduler past which new work is refused as overloaded
    /// (`scheduler.mailbox_capacity`).
    pub mailbox_capacity: usize,
    /// Bounds on the API's connections (`server.max_connections`,
    /// `server.header_read_timeout_s`).
    pub conn_limits: crate::http::ConnLimits,
    /// Per-request deadline.
    pub request_timeout: Duration,
    /// Bound on one call between the instance's actors.
    pub call_timeout: Duration,
    /// How long a stop lets running requests and hand-offs finish.
    pub drain_timeout: Duration,
    /// Bearer token required by the API.
    pub api_key: Option<String>,
    /// HTTPS of the API and the trust of outgoing calls (default: plain HTTP, system roots).
    pub tls: HttpTls,
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
    pub transfer_mode: TransferMode,
    /// As decode: prompts shorter than this are prefilled here (conditional disaggregation).
    pub min_remote_prompt_tokens: usize,
    /// The prefix cache (`scheduler.prefix_cache`).
    pub prefix_cache: bool,
    /// Bound on each step of a KV hand-off (handshake, connect, a batch, a lease call).
    pub kv_timeout: Duration,
    /// Test-only fault injection (`[faults]`).
    pub faults: Option<Arc<pdserve_runtime::faults::FaultInjector>>,
    /// The control plane (`pdserve inspect`, registration with a proxy, the P/D peer
    /// protocol); `None`: no control endpoint.
    pub control: Option<InstanceControl>,
    /// Limits on image input (`[multimodal]`; vision-language models).
    pub multimodal: pdserve_runtime::config::MultimodalSection,
    /// KV cache tiers below the block pool (`[kv_tiers]`); `None`: off. Needs the prefix
    /// cache; refused with a device KV cache ([`RankDevice::private_kv`]).
    pub kv_tiers: Option<crate::kv_tiers::TierSettings>,
    /// Where the ranks run (`model.device`) and, with a device KV cache, its host mirror
    /// (by `instance.role`): CPU by default.
    pub device: RankDevice,
    /// An encode instance (`instance.role = "encode"`, E/P/D): serves `POST /v1/encode` and
    /// the encoder protocol from a hold region on its transfer engine. Needs a
    /// vision-language model and a transfer engine.
    pub encode: bool,
}

impl InstanceOptions {
    /// Options from a loaded [`ServeConfig`].
    ///
    /// # Errors
    /// [`StartError::Config`] when the host/port, transfer settings or
    /// control-plane credentials in the config do not parse.
    pub fn from_config(cfg: &ServeConfig, model: LoadedModel) -> Result<Self, StartError> {
        let vision = model.vision.is_some();
        let bind: SocketAddr = format!("{}:{}", cfg.server.host, cfg.server.port)
            .parse()
            .map_err(|e| StartError::config("server.host/server.port", e))?;
        Ok(Self {
            name: cfg.instance.name.clone(),
            model,
            served_name: cfg.model.name.clone(),
            tp: cfg.model.tp,
            weights: cfg.model.weights,
            max_num_seqs: cfg.scheduler.max_num_seqs,
            max_num_batched_tokens: cfg.scheduler.max_num_batched_tokens,
            block_size: cfg.scheduler.block_size,
            num_blocks: cfg.scheduler.num_blocks,
            kv_cache_bytes: cfg.scheduler.kv_cache_bytes as usize,
            kv_dtype: cfg.scheduler.kv_cache_dtype.into(),
            watermark: cfg.scheduler.watermark,
            max_model_len: cfg.scheduler.max_model_len,
            bind: Some(bind),
            max_concurrent_requests: cfg.server.max_concurrent_requests,
            mailbox_capacity: cfg.scheduler.mailbox_capacity,
            conn_limits: crate::http::ConnLimits {
                max_connections: cfg.server.max_connections,
                header_read_timeout: Duration::from_secs(cfg.server.header_read_timeout_s),
            },
            request_timeout: Duration::from_secs(cfg.server.request_timeout_s),
            call_timeout: Duration::from_millis(cfg.server.actor_call_timeout_ms),
            drain_timeout: Duration::from_secs(cfg.server.drain_timeout_s),
            api_key: cfg.server.api_key.clone(),
            tls: HttpTls::load(
                cfg.server.tls_cert.as_deref().map(Path::new),
                cfg.server.tls_key.as_deref().map(Path::new),
                cfg.server.tls_ca.as_deref().map(Path::new),
                ["server.tls_cert", "server.tls_key", "server.tls_ca"],
            )
            .map_err(|e| StartError::config("server.tls_*", e))?,
            restart_policy: RestartPolicy::default(),
            alloc: Arc::new(AnonAllocator),
            // A colocated vision-language model takes image embeddings from encode
            // instances over a transfer engine (host KV only: a device KV cache needs a role
            // with a mirror for one).
            transfer: transfer_config(cfg, vision && !rank_device(cfg)?.private_kv())?,
            kv_lease: Duration::from_secs(cfg.transfer.kv_lease_s),
            transfer_mode: cfg.transfer.mode,
            min_remote_prompt_tokens: cfg.transfer.min_remote_prompt_tokens,
            prefix_cache: cfg.scheduler.prefix_cache,
            kv_timeout: Duration::from_secs(cfg.transfer.timeout_s),
            faults: pdserve_runtime::faults::FaultInjector::new(&cfg.faults),
            control: InstanceControl::from_config(cfg)?,
            multimodal: cfg.multimodal.clone(),
            kv_tiers: tier_settings(cfg),
            device: rank_device(cfg)?,
            encode: cfg.instance.role == pdserve_runtime::Role::Encode,
        })
    }

    /// Defaults for tests and embedding: 127.0.0.1 on a free port, small pool.
    pub fn local(name: &str, model: LoadedModel) -> Self {
        Self {
            name: name.to_string(),
            model,
            served_name: Vec::new(),
            tp: 1,
            weights: WeightFormat::Auto,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            block_size: 16,
            num_blocks: Some(256),
            kv_cache_bytes: 0,
            kv_dtype: KvDtype::F32,
            watermark: 0.01,
            max_model_len: None,
            bind: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            max_concurrent_requests: 256,
            mailbox_capacity: 4096,
            conn_limits: crate::http::ConnLimits::default(),
            request_timeout: Duration::from_secs(120),
            call_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            api_key: None,
            tls: HttpTls::default(),
            restart_policy: RestartPolicy::default(),
            alloc: Arc::new(AnonAllocator),
            transfer: None,
            kv_lease: Duration::from_secs(30),
            transfer_mode: TransferMode::Pull,
            min_remote_prompt_tokens: 0,
            prefix_cache: true,
            kv_timeout: Duration::from_secs(30),
            faults: None,
            control: None,
            multimodal: Default::default(),
            kv_tiers: None,
            device: RankDevice::Cpu,
            encode: false,
        }
    }
}

/// `model.device` (and `model.dtype`) as the workers take it; a CUDA rank's KV mirror by
/// `instance.role` ([`KvMirror::for_role`]).
fn rank_device(cfg: &ServeConfig) -> Result<RankDevice, StartError> {
    let device: pdserve_gpu::device::Device = cfg
        .model
        .device
        .parse()
        .map_err(|e| StartError::config("model.device", e))?;
    RankDevice::for_device(device, &cfg.model.dtype, cfg.instance.role)
        .map_err(|e| StartError::config("model.device", e))
}

/// Refuses what a device KV cache cannot do (docs/cuda.md, "Wiring into the actors"): the
/// KV tiers read and write the host KV cache directly; an instance with a transfer engine
/// for KV needs a KV mirror for peers to reach its KV (a vision-language model's engine may
/// carry image rows alone); the CUDA cache is f32.
fn check_device(opts: &InstanceOptions) -> Result<(), StartError> {
    let device = &opts.device;
    if !device.private_kv() {
        return Ok(());
    }
    if opts.kv_tiers.is_some() && opts.prefix_cache {
        return Err(StartError::config(
            "kv_tiers",
            format!(
                "the KV cache tiers copy blocks out of and into the host KV cache, and this                  instance keeps its KV on the device (model.device {}): turn kv_tiers off",
                device.name()
            ),
        ));
    }
    // A vision-language model's engine also carries image rows (E/P/D): a colocated or encode
    // instance keeps it with its KV on the device, and refuses to hand KV to peers
    // (`SchedulerArgs::serves_kv`).
    if opts.transfer.is_some() && device.mirror() == KvMirror::Off && opts.model.vision.is_none() {
        return Err(StartError::config(
            "instance.role",
            format!(
                "a KV transfer engine on a device KV cache (model.device {}) needs a host                  mirror: role prefill (write-through) or decode (receive)",
                device.name()
            ),
        ));
    }
    #[cfg(feature = "cuda")]
    if matches!(device, RankDevice::Cuda { .. }) {
        if opts.kv_dtype == KvDtype::Bf16 {
            return Err(StartError::config(
                "scheduler.kv_cache_dtype",
                "the CUDA KV cache is f32 or f16 (no kernel reads a bf16 cache)",
            ));
        }
        if opts.weights != WeightFormat::Auto {
            return Err(StartError::config(
                "model.weights",
                "on CUDA the weight type is model.dtype; model.weights must be auto",
            ));
        }
    }
    Ok(())
}

/// `[kv_tiers]` as the tiers take it (`None` when off).
fn tier_settings(cfg: &ServeConfig) -> Option<crate::kv_tiers::TierSettings> {
    use pdserve_runtime::config::TierWritePolicy;
    let t = &cfg.kv_tiers;
    t.enabled.then(|| crate::kv_tiers::TierSettings {
        host_capacity_bytes: t.host_capacity_bytes,
        disk_dir: t.disk_dir.as_ref().map(std::path::PathBuf::from),
        disk_capacity_bytes: t.disk_capacity_bytes,
        shared_dir: t.shared_dir.as_ref().map(std::path::PathBuf::from),
        shared_url: t.shared_url.clone(),
        shared_capacity_bytes: t.shared_capacity_bytes,
        load_timeout: std::time::Duration::from_millis(t.load_timeout_ms),
        stream_layers: t.stream_layers,
        write_policy: match t.write_policy {
            TierWritePolicy::WriteBack => crate::kv_tiers::WritePolicy::WriteBack,
            TierWritePolicy::Selective => crate::kv_tiers::WritePolicy::Selective {
                min_hits: t.selective_min_hits,
            },
        },
    })
}

/// A fingerprint of a model's weights for the KV tiers' compatibility key (two models of the
/// same shape must never exchange KV): XXH3-64 over every tensor's name, type, shape and
/// first 64 KiB of data, in name order.
fn weights_fingerprint(store: &pdserve_gpu::weights::TensorStore) -> u64 {
    let mut names: Vec<&String> = store.names().collect();
    names.sort();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for name in names {
        h.update(name.as_bytes());
        if let Ok(t) = store.get(name) {
            h.update(format!("{:?}{:?}", t.dtype(), t.shape().dims()).as_bytes());
            if let Ok(data) = t.data() {
                h.update(&data[..data.len().min(64 << 10)]);
            }
        }
    }
    h.digest()
}

/// What [`image_services`] builds.
type ImageServices = (
    Option<Arc<crate::encode::EncoderService>>,
    Option<Arc<crate::encode::ImageResolver>>,
);

/// An encode instance's encoder service, and the image resolver of any instance of a
/// vision-language model with a transfer engine (built once per instance: a restarted
/// HttpFrontend keeps them).
#[allow(clippy::too_many_arguments)]
fn image_services(
    name: &str,
    encode: bool,
    timeout: Duration,
    lease: Duration,
    model_name: &str,
    store: &pdserve_gpu::weights::TensorStore,
    vision: Option<&Arc<pdserve_gpu::vision::VisionTower>>,
    kv: Option<&Arc<KvContext>>,
    cache: &Arc<crate::multimodal::EncoderCache>,
    multimodal: &pdserve_runtime::config::MultimodalSection,
) -> Result<ImageServices, StartError> {
    let (Some(tower), Some(kv)) = (vision, kv) else {
        if encode {
            return Err(StartError::config(
                "instance.role",
                "role encode needs a vision-language model (a model with a vision tower) and a transfer engine",
            ));
        }
        return Ok((None, None));
    };
    let model = format!("{model_name} weights={:016x}", weights_fingerprint(store));
    let engine = kv.registry.engine().clone();
    let encoder = if encode {
        let settings = crate::encode::EncoderSettings {
            engine_id: name.to_string(),
            model: model.clone(),
            slots: multimodal.encoder_hold_slots,
            lease,
        };
        let service =
            crate::encode::EncoderService::new(settings, engine.clone(), tower, cache.clone())
                .map_err(|e| StartError::Transfer(e.to_string()))?;
        let service = Arc::new(service);
        service.expire_every((lease / 8).max(Duration::from_millis(10)));
        Some(service)
    } else {
        None
    };
    let cfg = tower.config();
    // Encoders with cluster credentials are reached over the control plane, others over
    // their HTTP route: the peer client carries both.
    let client = crate::encode::EncoderClient::new(
        name.to_string(),
        engine,
        kv.peers.clone(),
        timeout,
        crate::encode::Expect {
            model,
            preprocessing: cfg.preprocessing_key(),
            rows: cfg.tokens_per_image(),
            width: cfg.text_hidden_size,
        },
    );
    let resolver = crate::encode::ImageResolver {
        client,
        cache: cache.clone(),
        image_token: cfg.image_token_id,
        rows: cfg.tokens_per_image(),
    };
    Ok((encoder, Some(Arc::new(resolver))))
}

/// The transfer engine of a `prefill`, `decode` or `encode` instance, and of a `colocated`
/// one serving a vision-language model (it takes image embeddings from encode instances);
/// none for a colocated text model.
fn transfer_config(
    cfg: &ServeConfig,
    vision: bool,
) -> Result<Option<pdserve_transport::TransferConfig>, StartError> {
    if !cfg.instance.role.transfers() && !vision {
        return Ok(None);
    }
    // Every `[transfer]` key (backend, listen and advertised address, I/O knobs, keys and
    // integrity, RDMA devices) through one constructor, so none is left unreachable.
    let t = crate::transfer_config::from_serve_config(cfg)
        .map_err(|e| StartError::config("[transfer]", e))?;
    Ok(Some(t))
}

/// What each phase of [`Instance::stop`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ShutdownReport {
    /// Requests still running or waiting when the drain bound passed (they were cut off).
    pub requests_cut_off: usize,
    /// KV hand-offs still in flight when the drain bound passed (they were cancelled).
    pub handoffs_cut_off: u64,
    /// Hand-offs whose KV was still held for a decode instance when the drain bound passed
    /// (neither read nor expired; dropped with the instance).
    pub held_cut_off: usize,
    /// Whether every hand-off task had ended before the actors stopped.
    pub handoff_tasks_ended: bool,
    /// Free blocks when the actors stopped.
    pub blocks_free: usize,
    /// All blocks.
    pub blocks_total: usize,
    /// Whether every control-plane task had ended at the end.
    pub control_tasks_ended: bool,
    /// Blocks of the KV tiers' host region written to the disk tier at the stop.
    pub tier_blocks_persisted: usize,
    /// How long the stop took.
    pub elapsed: Duration,
}

impl ShutdownReport {
    /// Whether nothing was lost: every block back, every task ended.
    pub fn clean(&self) -> bool {
        self.blocks_free == self.blocks_total
            && self.held_cut_off == 0
            && self.handoff_tasks_ended
            && self.control_tasks_ended
    }
}

/// A running instance.
pub struct Instance {
    tiers: Option<Arc<crate::kv_tiers::KvTiers>>,
    supervisor: SupervisorHandle,
    join: tokio::task::JoinHandle<()>,
    scheduler: SchedulerHandle,
    addr: Option<SocketAddr>,
    model_name: String,
    control: Option<ControlPlane>,
    kv: Option<Arc<KvContext>>,
    app: Option<Arc<AppState>>,
    drain_timeout: Duration,
    max_concurrent_requests: usize,
    /// `http` or `https`.
    scheme: &'static str,
}

impl Instance {
    /// Starts the supervision tree; returns once every rank is loaded and the API listens.
    ///
    /// # Errors
    /// Model sharding, memory, bind or control-plane failures, naming the failing part.
    pub async fn start(opts: InstanceOptions) -> Result<Self, StartError> {
        check_device(&opts)?;
        let model = opts.model;
        // The structured-output compiler (a token trie over the vocabulary) is built in the
        // background now, not by the first constrained request.
        let warm = model.tokenizer.clone();
        tokio::task::spawn_blocking(move || pdserve_gpu::grammar::GrammarCompiler::warm(&warm));
        let cfg = model.config.clone();
        cfg.check_tp(opts.tp)
            .map_err(|e| StartError::config("model.tp", e))?;
        let bytes_per_block_all_ranks = 2
            * cfg.num_layers
            * cfg.num_kv_heads
            * opts.block_size
            * cfg.head_dim
            * opts.kv_dtype.size();
        // An encode instance generates nothing: its KV pool is one block, not
        // `kv_cache_bytes` of memory it would never use.
        let num_blocks = if opts.encode {
            1
        } else {
            opts.num_blocks
                .unwrap_or(opts.kv_cache_bytes / bytes_per_block_all_ranks)
                .max(1)
        };
        let max_model_len = opts
            .max_model_len
            .unwrap_or(cfg.context_length)
            .min(cfg.context_length);
        let own_name = model.name.clone();
        let served_names = if opts.served_name.is_empty() {
            vec![own_name.clone()]
        } else {
            opts.served_name.clone()
        };
        let served = served_names[0].clone();
        let worker = WorkerSpec {
            config: cfg.clone(),
            store: Arc::new(model.store),
            opts: TpOptions {
                tp: opts.tp,
                num_blocks,
                block_size: opts.block_size,
                format: opts.weights,
                kv_dtype: opts.kv_dtype,
            },
            alloc: opts.alloc,
            faults: opts.faults.clone(),
            device: opts.device.clone(),
        };
        let epochs = Epochs::new(opts.tp);
        let endpoint = opts
            .control
            .as_ref()
            .map(|ctl| ControlPlane::bind(ctl, &opts.name))
            .transpose()?;
        let kv = match opts.transfer {
            Some(tcfg) => {
                let engine = pdserve_transport::TransferEngine::new(tcfg)
                    .map_err(|e| StartError::Transfer(e.to_string()))?;
                let registry = KvRegistry::new(Arc::new(engine), opts.tp, opts.faults.clone());
                let peers = Peers::new(
                    opts.name.clone(),
                    endpoint.clone(),
                    opts.api_key.clone(),
                    opts.faults.clone(),
                    opts.kv_timeout,
                    opts.tls.client(),
                );
                let settings = KvSettings {
                    engine_id: opts.name.clone(),
                    model: cfg.clone(),
                    tp: opts.tp,
                    num_blocks,
                    block_size: opts.block_size,
                    dtype: opts.kv_dtype,
                    bounds: PullBounds {
                        transfer: opts.kv_timeout,
                        prefill: opts.request_timeout,
                    },
                    mode: opts.transfer_mode,
                    min_remote_prompt_tokens: opts.min_remote_prompt_tokens,
                    lease: opts.kv_lease,
                    faults: opts.faults.clone(),
                };
                Some(Arc::new(KvContext::new(
                    settings,
                    registry,
                    peers,
                    epochs.clone(),
                )))
            }
            None => None,
        };
        // One encoder cache for the instance: a restarted HttpFrontend or VisionEncoder
        // keeps it.
        let encoder_cache = Arc::new(crate::multimodal::EncoderCache::new(
            usize::try_from(opts.multimodal.encoder_cache_bytes).unwrap_or(usize::MAX),
        ));
        let app_factory = {
            let (tokenizer, chat_template, model_name) = (
                model.tokenizer.clone(),
                model.chat_template.clone(),
                served.clone(),
            );
            let (served_names, own_name) = (served_names.clone(), own_name.clone());
            let mailbox_capacity = opts.mailbox_capacity;
            let (max_concurrent, conn_limits, timeout, api_key, call_timeout) = (
                opts.max_concurrent_requests,
                opts.conn_limits,
                opts.request_timeout,
                opts.api_key.clone(),
                opts.call_timeout,
            );
            let vocab_size = cfg.vocab_size;
            let kv = kv.clone();
            let tls = opts.tls.clone();
            let grammar_tokenizer = model.tokenizer.clone();
            let (vision, multimodal) = (model.vision.clone(), opts.multimodal.clone());
            let encoder_cache = encoder_cache.clone();
            let (encoder, images) = image_services(
                &opts.name,
                opts.encode,
                opts.kv_timeout,
                opts.kv_lease,
                &own_name,
                &worker.store,
                vision.as_ref(),
                kv.as_ref(),
                &encoder_cache,
                &multimodal,
            )?;
            move |scheduler: Mailbox<SchedulerMsg>, kv_sender, vision_encoder| {
                let scheduler =
                    SchedulerHandle::new(scheduler.with_capacity(mailbox_capacity), call_timeout)
                        .with_tokenizer(grammar_tokenizer.clone());
                let admission = Arc::new(tokio::sync::Semaphore::new(max_concurrent));
                let peer = kv.as_ref().map(|kv| {
                    let sweep = (kv.settings.lease / 8).max(Duration::from_millis(10));
                    let service = Arc::new(
                        PeerService::new(
                            kv.clone(),
                            scheduler.clone(),
                            kv_sender,
                            admission.clone(),
                            PromptLimits {
                                vocab_size,
                                max_model_len,
                            },
                        )
                        .with_images(images.clone()),
                    );
                    service.expire_reads_every(sweep);
                    service
                });
                Arc::new(AppState {
                    scheduler,
                    tokenizer,
                    chat_template,
                    model_name,
                    served_names: served_names.clone(),
                    own_model_name: own_name.clone(),
                    max_model_len,
                    vocab_size,
                    admission,
                    max_concurrent_requests: max_concurrent,
                    conn_limits,
                    request_timeout: timeout,
                    api_key,
                    metrics: pdserve_runtime::telemetry::install_metrics(),
                    kv,
                    peer,
                    addr: std::sync::OnceLock::new(),
                    ready: std::sync::atomic::AtomicBool::new(true),
                    tls: tls.clone(),
                    drain: tokio_util::sync::CancellationToken::new(),
                    vision: vision.clone(),
                    multimodal: multimodal.clone(),
                    encoder: encoder.clone(),
                    images: images.clone(),
                    vision_encoder,
                })
            }
        };
        let kv_compat = compat_key(
            &cfg,
            opts.block_size,
            &pdserve_gpu::kv::KvLayout {
                num_layers: cfg.num_layers,
                num_blocks,
                block_size: opts.block_size,
                num_kv_heads: cfg.num_kv_heads / opts.tp,
                head_dim: cfg.head_dim,
                dtype: opts.kv_dtype,
            },
        );
        let cache_salt = crate::block_manager::cache_salt(&kv_compat);
        let tiers = match opts.kv_tiers.filter(|_| opts.prefix_cache) {
            Some(settings) => {
                let shape = crate::kv_tiers::TierShape {
                    compat: format!(
                        "{} tp={} weights={:016x}",
                        kv_compat,
                        opts.tp,
                        weights_fingerprint(&worker.store),
                    ),
                    block_size: opts.block_size,
                    payload_bytes: bytes_per_block_all_ranks,
                    tp: opts.tp,
                    layers: cfg.num_layers,
                };
                // Opening verifies every file of the disk tier: off the async threads.
                let tiers = tokio::task::spawn_blocking(move || {
                    crate::kv_tiers::KvTiers::open(settings, shape, cache_salt)
                })
                .await
                .map_err(|e| StartError::config("kv_tiers", e))?
                .map_err(|e| StartError::config(e.key, e.error))?;
                Some(Arc::new(tiers))
            }
            None => None,
        };
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
                prefix_cache: opts.prefix_cache,
                cache_salt,
                min_remote_prompt_tokens: opts.min_remote_prompt_tokens,
            },
            tokenizer: model.tokenizer.clone(),
            app: Box::new(app_factory),
            http: opts.bind,
            restart_policy: opts.restart_policy,
            kv: kv.clone(),
            epochs,
            call_timeout: opts.call_timeout,
            tiers: tiers.clone(),
            encoder: model
                .vision
                .clone()
                .map(|tower| crate::encode::VisionEncoderArgs {
                    tower,
                    cfg: opts.multimodal.clone(),
                    cache: encoder_cache.clone(),
                }),
        };
        let (supervisor, join) = Mailbox::spawn(
            Some(format!("{}/supervisor", opts.name)),
            InstanceSupervisor,
            args,
        )
        .await
        .map_err(|e| StartError::actor(format!("instance {}", opts.name), e))?;
        let supervisor = SupervisorHandle::new(supervisor, opts.call_timeout);
        let (scheduler, addr, app) = supervisor
            .handles()
            .await
            .map_err(|e| StartError::actor("the instance supervisor", e))?;
        let scheduler = SchedulerHandle::new(
            scheduler.with_capacity(opts.mailbox_capacity),
            opts.call_timeout,
        );
        let control = match (opts.control, endpoint) {
            (Some(ctl), Some(endpoint)) => {
                let source = InspectSource {
                    name: opts.name.clone(),
                    role: ctl.role,
                    model: served.clone(),
                    tp: opts.tp,
                    supervisor: supervisor.clone(),
                    scheduler: scheduler.clone(),
                    kv: kv.clone(),
                    peer: app.as_ref().and_then(|a| a.peer.clone()),
                    encoder: app.as_ref().and_then(|a| a.encoder.clone()),
                    kv_scheme: opts.prefix_cache.then_some(crate::kv_events::HashScheme {
                        block_size: opts.block_size,
                        salt: cache_salt,
                    }),
                    tiers: tiers.clone(),
                };
                let url = addr.map(|a| format!("{}://{a}", opts.tls.scheme()));
                match ControlPlane::start(ctl, endpoint, source, url) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        supervisor
                            .mailbox()
                            .stop(Some("control plane failed".into()));
                        let _ = tokio::time::timeout(Duration::from_secs(10), join).await;
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        Ok(Self {
            tiers,
            supervisor,
            join,
            scheduler,
            addr,
            model_name: served,
            control,
            kv,
            app,
            drain_timeout: opts.drain_timeout,
            max_concurrent_requests: opts.max_concurrent_requests,
            scheme: opts.tls.scheme(),
        })
    }

    /// The KV cache tiers, when on.
    pub fn kv_tiers(&self) -> Option<&Arc<crate::kv_tiers::KvTiers>> {
        self.tiers.as_ref()
    }

    /// The KV hand-off context (instances with a transfer engine): where TP ranks with
    /// device KV register it ([`KvContext::set_device`]).
    pub fn kv_context(&self) -> Option<&Arc<KvContext>> {
        self.kv.as_ref()
    }

    /// KV hand-off figures (instances with a transfer engine).
    pub fn kv_figures(&self) -> Option<KvFigures> {
        self.kv.as_ref().map(|k| k.figures())
    }

    /// The API address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// `http://host:port` (`https://` with TLS) of the API.
    pub fn url(&self) -> String {
        self.addr
            .map(|a| format!("{}://{a}", self.scheme))
            .unwrap_or_default()
    }

    /// The control plane, when the instance has cluster credentials.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.control.as_ref()
    }

    /// The served model name.
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The scheduler, for in-process clients.
    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.scheduler
    }

    /// Queue and pool figures.
    ///
    /// # Errors
    /// When the scheduler is gone or slow.
    pub async fn stats(&self) -> Result<SchedulerStats, RequestError> {
        self.scheduler.stats().await
    }

    /// The live actor tree.
    ///
    /// # Errors
    /// When the supervisor is gone or slow.
    pub async fn snapshot(&self) -> Result<ActorSnapshot, RequestError> {
        self.supervisor.snapshot().await
    }

    /// Submits a request from inside the process (no HTTP): its events arrive on the returned
    /// stream; dropping it aborts the request.
    ///
    /// # Errors
    /// When the scheduler is gone.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: pdserve_gpu::sampling::SamplingParams,
    ) -> Result<RequestStream, RequestError> {
        let request = NewRequest {
            id: self.scheduler.next_request_id(),
            prompt,
            params,
            hold_for: None,
            push: false,
            resume: Vec::new(),
            constraint: None,
            images: Vec::new(),
        };
        self.scheduler.submit(request)
    }

    /// Test-only fault hook: the actor of `kind` (for `TpWorker`, of rank `rank`) panics as
    /// it takes its next message; its supervisor then acts on the failure.
    ///
    /// # Errors
    /// When the instance has no such actor, or its supervisor is gone.
    pub async fn inject_panic(&self, kind: &str, rank: usize) -> Result<(), RequestError> {
        let kind: pdserve_runtime::supervision::ActorKind =
            kind.parse()
                .map_err(|e: pdserve_runtime::supervision::UnknownActorKind| {
                    RequestError::BadRequest(e.to_string())
                })?;
        if self.supervisor.inject_panic(kind, rank).await? {
            Ok(())
        } else {
            Err(RequestError::BadRequest(format!(
                "instance has no {kind} actor (rank {rank})"
            )))
        }
    }

    /// Resolves when a drain was asked for over the API (`POST /drain`); never without an
    /// HTTP frontend. The owner then calls [`Instance::stop`], as on SIGTERM. The future does
    /// not borrow the instance.
    pub fn drain_requested(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let token = self.app.as_ref().map(|a| a.drain.clone());
        async move {
            match token {
                Some(t) => t.cancelled().await,
                None => std::future::pending().await,
            }
        }
    }

    /// Whether the supervision tree is still running.
    pub fn is_running(&self) -> bool {
        !self.join.is_finished()
    }

    /// Stops the instance in phases (see the module docs) and reports what each found.
    pub async fn stop(mut self) -> ShutdownReport {
        let started = Instant::now();
        let mut report = ShutdownReport::default();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        // 1. Stop admitting.
        if let Some(app) = &self.app {
            app.ready.store(false, Ordering::SeqCst);
        }
        let admission = self.app.as_ref().map(|a| a.admission.clone());
        // 2. Leave the routing set: the proxy stops routing here at once. It keeps the entry
        //    (shown `draining` by inspect) until the control plane closes at the end; a proxy
        //    that does not acknowledge gets the registration closed instead.
        if let Some(control) = &mut self.control {
            if !control.announce_draining().await {
                control.deregister();
            }
        }
        // 3. Drain: every admitted request returns its slot when it ends.
        let mut _every_slot = None;
        let drained = match &admission {
            Some(a) => {
                let all = u32::try_from(self.max_concurrent_requests).unwrap_or(u32::MAX);
                match tokio::time::timeout_at(deadline, a.clone().acquire_many_owned(all)).await {
                    Ok(Ok(permits)) => {
                        // Held until the end: nothing new is admitted.
                        _every_slot = Some(permits);
                        true
                    }
                    _ => false,
                }
            }
            None => true,
        };
        if let Some(a) = &admission {
            a.close();
        }
        // A prefill instance keeps the KV it holds for decode instances until they have read
        // it (their `Release`) or its lease ran out, within the same bound: the peer protocol
        // keeps answering meanwhile.
        let held_left = loop {
            match self.scheduler.stats().await {
                Ok(s) if s.held > 0 => {
                    if tokio::time::Instant::now() >= deadline {
                        break s.held;
                    }
                }
                _ => break 0,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        report.held_cut_off = held_left;
        if held_left > 0 {
            tracing::warn!(
                held = held_left,
                "drain bound passed with KV still held for decode instances"
            );
        }
        if !drained {
            let s = self.scheduler.stats().await.unwrap_or_default();
            report.requests_cut_off = s.running + s.waiting;
            tracing::warn!(
                running = s.running,
                waiting = s.waiting,
                "drain bound passed: cutting off what is left"
            );
        }
        if let Some(kv) = &self.kv {
            report.handoffs_cut_off = if drained {
                0
            } else {
                kv.figures().transfers_in_flight
            };
            // Hand-offs end by their own bounds; after the drain bound they are cancelled.
            kv.background.cancel();
            kv.tasks.close();
            if tokio::time::timeout_at(deadline, kv.tasks.wait())
                .await
                .is_err()
            {
                kv.shutdown.cancel();
            }
            report.handoff_tasks_ended = tokio::time::timeout(
                kv.bounds().transfer + Duration::from_secs(1),
                kv.tasks.wait(),
            )
            .await
            .is_ok();
            kv.peers.close().await;
            // No session we granted reaches our memory any more.
            kv.grants.revoke_all();
        } else {
            report.handoff_tasks_ended = true;
        }
        // 4. Stop the actors (the pool is read first: what a stop leaves behind).
        if let Ok(s) = self.scheduler.stats().await {
            report.blocks_free = s.blocks_free;
            report.blocks_total = s.blocks_total;
        }
        self.supervisor.mailbox().stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.join).await;
        // The host region of the KV tiers dies with the process: what it holds goes to the
        // disk tier so a restart finds it warm (bounded by what is left of the drain bound,
        // at least a few seconds).
        if let Some(tiers) = self.tiers.clone() {
            let until = std::time::Instant::now()
                + deadline
                    .saturating_duration_since(tokio::time::Instant::now())
                    .max(Duration::from_secs(5));
            report.tier_blocks_persisted =
                tokio::task::spawn_blocking(move || tiers.persist(until))
                    .await
                    .unwrap_or(0);
        }
        // 5. Close the control plane and (with the last reference) the transfer engine.
        report.control_tasks_ended = match &mut self.control {
            Some(c) => {
                c.shutdown();
                c.wait(Duration::from_secs(5)).await
            }
            None => true,
        };
        self.app = None;
        self.kv = None;
        report.elapsed = started.elapsed();
        tracing::info!(?report, "instance stopped");
        report
    }

    /// Resolves when the supervision tree has stopped by itself (an escalated failure).
    pub async fn stopped(&mut self) {
        let _ = (&mut self.join).await;
    }
}
