//! The tree of an instance's serving configuration: [`ServeConfig`] and its sections, with
//! their built-in defaults. Loading it is in `config.rs` (over `layers.rs`), checking it in
//! `validate.rs`.

use serde::{Deserialize, Serialize};

use super::lenient;
use super::values::*;

/// The whole serving configuration of one instance.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Which model to serve and how.
    pub model: ModelConfig,
    /// The HTTP frontend.
    pub server: ServerConfig,
    /// Batching and the paged KV cache.
    pub scheduler: SchedulerConfig,
    /// This instance's identity in the cluster.
    pub instance: InstanceConfig,
    /// Log output.
    pub logging: LoggingConfig,
    /// KV hand-off between prefill and decode instances.
    pub transfer: TransferSection,
    /// The control plane: registration with the proxy, heartbeats, `pdserve inspect`.
    pub control: ControlSection,
    /// Test-only fault injection (reliability suite, drills); all off by default.
    pub faults: crate::faults::FaultSection,
    /// Image input of vision-language models: limits per request.
    pub multimodal: MultimodalSection,
    /// KV cache tiers below the block pool: host spill region and local disk.
    pub kv_tiers: KvTiersConfig,
}

/// `[multimodal]`: what one request may send as images (vision-language models; a
/// text-only model refuses every image). Checked before an image is decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultimodalSection {
    /// Most images in one request (1..=64).
    pub max_images_per_request: usize,
    /// Most bytes of one encoded image (after base64 decoding), 1 byte ..= 64 MiB.
    pub max_image_bytes: u64,
    /// Widest image in pixels (1..=16384).
    pub max_image_width: u32,
    /// Tallest image in pixels (1..=16384).
    pub max_image_height: u32,
    /// Bytes of image embeddings the encoder cache keeps (by image digest, least recently
    /// used evicted first); 0 turns it off. At most 16 GiB.
    pub encoder_cache_bytes: u64,
    /// An encode instance's hold slots (1..=4096): images whose embeddings wait, under a
    /// lease, for the instance computing the prompt to read them over the transfer engine.
    pub encoder_hold_slots: usize,
}

impl Default for MultimodalSection {
    fn default() -> Self {
        Self {
            max_images_per_request: 8,
            max_image_bytes: 4 << 20,
            max_image_width: 4096,
            max_image_height: 4096,
            encoder_cache_bytes: 64 << 20,
            encoder_hold_slots: 64,
        }
    }
}

impl MultimodalSection {
    /// The first key out of range and why.
    pub fn invalid(&self) -> Option<(&'static str, String)> {
        if !(1..=64).contains(&self.max_images_per_request) {
            return Some((
                "multimodal.max_images_per_request",
                format!(
                    "multimodal.max_images_per_request must be 1..=64, got {}",
                    self.max_images_per_request
                ),
            ));
        }
        if !(1..=64 << 20).contains(&self.max_image_bytes) {
            return Some((
                "multimodal.max_image_bytes",
                format!(
                    "multimodal.max_image_bytes must be 1..=67108864 (64 MiB), got {}",
                    self.max_image_bytes
                ),
            ));
        }
        if !(1..=4096).contains(&self.encoder_hold_slots) {
            return Some((
                "multimodal.encoder_hold_slots",
                format!(
                    "multimodal.encoder_hold_slots must be 1..=4096, got {}",
                    self.encoder_hold_slots
                ),
            ));
        }
        if self.encoder_cache_bytes > 16 << 30 {
            return Some((
                "multimodal.encoder_cache_bytes",
                format!(
                    "multimodal.encoder_cache_bytes must be at most 17179869184 (16 GiB), got {}",
                    self.encoder_cache_bytes
                ),
            ));
        }
        for (key, v) in [
            ("multimodal.max_image_width", self.max_image_width),
            ("multimodal.max_image_height", self.max_image_height),
        ] {
            if !(1..=16384).contains(&v) {
                return Some((key, format!("{key} must be 1..=16384, got {v}")));
            }
        }
        None
    }
}

/// `[control]`: this instance's control-plane endpoint (mutual-TLS QUIC). It is enabled when
/// `transfer.credentials_dir` holds cluster credentials (the member is `instance.name`): the
/// instance then answers `pdserve inspect` and, with `proxy` set, registers with that proxy
/// and sends it heartbeats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlSection {
    /// Where the control endpoint listens (UDP); port 0 picks one. The instance also connects
    /// out to the proxy from this address, so it must be one the proxy can reach.
    #[serde(deserialize_with = "lenient::string")]
    pub listen: String,
    /// Control address (`IP:port`) of the proxy to register with; `None`: do not register.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub proxy: Option<String>,
    /// Milliseconds between heartbeats; the proxy stops routing to an instance that missed
    /// three.
    pub heartbeat_ms: u64,
    /// Where the proxies are: `control.proxy` (the default, `static`), or every proxy listed in
    /// etcd (`kind = "etcd"`: this instance keeps its own record there under a lease, and
    /// registers with each proxy that appears).
    pub discovery: super::DiscoveryConfig,
}

impl Default for ControlSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            proxy: None,
            heartbeat_ms: 500,
            discovery: super::DiscoveryConfig::default(),
        }
    }
}

/// Bounds of `control.heartbeat_ms`.
pub const HEARTBEAT_MS_RANGE: std::ops::RangeInclusive<u64> = 10..=60_000;

/// `[transfer]`: how this instance moves KV cache to or from its P/D peers (used by the
/// `prefill` and `decode` roles).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferSection {
    /// Transfer backend: `local`, `shm`, `tcp`, `quic` or `rdma`.
    pub backend: TransferBackend,
    /// Where the transfer engine listens (`shm` control, `tcp`, `quic`); port 0 picks one.
    pub listen: String,
    /// Seconds a prefill instance keeps a finished request's KV for its decode instance.
    pub kv_lease_s: u64,
    /// Cluster credentials directory (`pdserve cluster init`), required by `quic`.
    pub credentials_dir: Option<String>,
    /// How a decode instance asks for a prompt's KV when it drives the hand-off (requests
    /// from pdserve's proxy): `pull` (prefill holds the blocks, decode reads them) or `push`
    /// (decode sends its destination blocks, prefill writes each layer as it is computed).
    pub mode: TransferMode,
    /// Decode: prompts with fewer tokens than this are prefilled on the decode instance
    /// itself (conditional disaggregation); 0 sends every prompt to a prefill instance.
    pub min_remote_prompt_tokens: usize,
    /// Seconds every step of a KV hand-off may take (handshake, connect, a read or write
    /// batch, a lease call) before it fails.
    pub timeout_s: u64,
    /// The address peers are told to reach this engine at: an IP (the bound port is kept) or
    /// `IP:port`. `None`: the bound address, or, when `listen` is unspecified (`0.0.0.0`,
    /// `::`), the address of the interface that routes to the peer.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub advertise_addr: Option<String>,
    /// Threads of the transfer engine's I/O runtime.
    pub io_threads: usize,
    /// Copy threads of the `local` and `shm` backends: a transfer of several pieces is
    /// copied by all of them at once, and single-piece transfers spread over them.
    pub memcpy_threads: usize,
    /// Bounded queue depth of the transfer executors (batches, pieces per connection).
    pub queue_depth: usize,
    /// Largest piece one wire operation or copy moves; larger operations are split.
    pub piece_bytes: u64,
    /// Parallel data connections per peer (`tcp`).
    pub tcp_connections: usize,
    /// Largest single memory registration; larger regions are registered in chunks. `None`:
    /// the backend's default (1 GiB for `rdma`, one chunk otherwise).
    pub registration_chunk_bytes: Option<u64>,
    /// Require every transfer connection to prove a session key, even before the first grant.
    pub require_auth: bool,
    /// Protection of `tcp` frames of authenticated sessions: `none`, `mac` (AES-GCM tag over
    /// header and payload) or `encrypt` (AES-256-GCM).
    #[serde(deserialize_with = "lenient::string")]
    pub tcp_integrity: String,
    /// RDMA devices to use, comma-separated (`mlx5_0,mlx5_1`): batches are striped over them.
    /// Empty: the first device listed.
    #[serde(deserialize_with = "lenient::string")]
    pub rdma_devices: String,
    /// RDMA port number on each device.
    pub rdma_port: u8,
    /// GID table index (RoCE); `None`: the first RoCE v2 entry holding an IPv4 address.
    pub rdma_gid_index: Option<u32>,
    /// Path MTU in bytes (256, 512, 1024, 2048, 4096); `None`: the port's active MTU.
    pub rdma_mtu: Option<u32>,
    /// Work requests in flight per queue pair.
    pub rdma_send_queue_depth: u32,
    /// Completion-queue entries per queue pair (at least `rdma_send_queue_depth`).
    pub rdma_cq_depth: u32,
}

/// Values of `transfer.tcp_integrity`.
pub const TCP_INTEGRITY_MODES: &[&str] = &["none", "mac", "encrypt"];

/// The RDMA path MTUs a queue pair can use.
pub const RDMA_MTUS: &[u32] = &[256, 512, 1024, 2048, 4096];

impl Default for TransferSection {
    fn default() -> Self {
        Self {
            backend: TransferBackend::Shm,
            listen: "127.0.0.1:0".into(),
            kv_lease_s: 30,
            credentials_dir: None,
            mode: TransferMode::Pull,
            min_remote_prompt_tokens: 0,
            timeout_s: 30,
            advertise_addr: None,
            io_threads: 2,
            memcpy_threads: 2,
            queue_depth: 256,
            piece_bytes: 1 << 20,
            tcp_connections: 4,
            registration_chunk_bytes: None,
            require_auth: true,
            tcp_integrity: "none".into(),
            rdma_devices: String::new(),
            rdma_port: 1,
            rdma_gid_index: None,
            rdma_mtu: None,
            rdma_send_queue_depth: 512,
            rdma_cq_depth: 1024,
        }
    }
}

impl TransferSection {
    /// The RDMA devices named by `rdma_devices`, in order.
    pub fn rdma_device_list(&self) -> Vec<String> {
        self.rdma_devices
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Checks the engine knobs; `(key, message)` of the first bad one.
    pub fn invalid(&self) -> Option<(&'static str, String)> {
        if let Some(a) = &self.advertise_addr {
            if a.parse::<std::net::IpAddr>().is_err() && a.parse::<std::net::SocketAddr>().is_err()
            {
                return Some((
                    "transfer.advertise_addr",
                    format!("transfer.advertise_addr must be an IP or IP:port, got `{a}`"),
                ));
            }
        }
        if !(1..=64).contains(&self.io_threads) {
            return Some((
                "transfer.io_threads",
                format!(
                    "transfer.io_threads must be 1..=64, got {}",
                    self.io_threads
                ),
            ));
        }
        if !(1..=64).contains(&self.memcpy_threads) {
            return Some((
                "transfer.memcpy_threads",
                format!(
                    "transfer.memcpy_threads must be 1..=64, got {}",
                    self.memcpy_threads
                ),
            ));
        }
        if !(1..=1 << 20).contains(&self.queue_depth) {
            return Some((
                "transfer.queue_depth",
                format!(
                    "transfer.queue_depth must be 1..=1048576, got {}",
                    self.queue_depth
                ),
            ));
        }
        if !(4096..=1 << 30).contains(&self.piece_bytes) {
            return Some((
                "transfer.piece_bytes",
                format!(
                    "transfer.piece_bytes must be 4096..=1073741824, got {}",
                    self.piece_bytes
                ),
            ));
        }
        if !(1..=64).contains(&self.tcp_connections) {
            return Some((
                "transfer.tcp_connections",
                format!(
                    "transfer.tcp_connections must be 1..=64, got {}",
                    self.tcp_connections
                ),
            ));
        }
        if self.registration_chunk_bytes.is_some_and(|b| b < 4096) {
            return Some((
                "transfer.registration_chunk_bytes",
                "transfer.registration_chunk_bytes must be at least 4096 when set".into(),
            ));
        }
        if !TCP_INTEGRITY_MODES.contains(&self.tcp_integrity.as_str()) {
            return Some((
                "transfer.tcp_integrity",
                format!(
                    "transfer.tcp_integrity must be one of none, mac, encrypt, got `{}`",
                    self.tcp_integrity
                ),
            ));
        }
        let devices = self.rdma_device_list();
        if let Some(d) = devices.iter().find(|d| d.contains(char::is_whitespace)) {
            return Some((
                "transfer.rdma_devices",
                format!("transfer.rdma_devices: device name `{d}` contains whitespace"),
            ));
        }
        if self.rdma_port == 0 {
            return Some((
                "transfer.rdma_port",
                "transfer.rdma_port must be ≥ 1".into(),
            ));
        }
        if let Some(m) = self.rdma_mtu {
            if !RDMA_MTUS.contains(&m) {
                return Some((
                    "transfer.rdma_mtu",
                    format!("transfer.rdma_mtu must be 256, 512, 1024, 2048 or 4096, got {m}"),
                ));
            }
        }
        if !(1..=32768).contains(&self.rdma_send_queue_depth) {
            return Some((
                "transfer.rdma_send_queue_depth",
                format!(
                    "transfer.rdma_send_queue_depth must be 1..=32768, got {}",
                    self.rdma_send_queue_depth
                ),
            ));
        }
        if self.rdma_cq_depth < self.rdma_send_queue_depth || self.rdma_cq_depth > 1 << 22 {
            return Some((
                "transfer.rdma_cq_depth",
                format!(
                    "transfer.rdma_cq_depth must be between transfer.rdma_send_queue_depth ({}) \
                     and 4194304, got {}",
                    self.rdma_send_queue_depth, self.rdma_cq_depth
                ),
            ));
        }
        None
    }
}

/// `[model]`: the model to serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// `"default"` (the default model), a path (GGUF file or HF directory), or
    /// `"synthetic:NAME"` (a seeded synthetic model for tests).
    #[serde(deserialize_with = "lenient::string")]
    pub source: String,
    /// A vision-language model's vision tower: an `mmproj` GGUF beside the decoder's GGUF
    /// (llama.cpp's layout; SmolVLM's `idefics3` projector). Unset: the model as loaded.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub mmproj: Option<String>,
    /// The names the API serves the model under (vLLM's `--served-model-name`): one string
    /// or a list of aliases. The first is the primary name (`model` of every response); a
    /// request may name any of them or the model's own name. Empty: the model's own name.
    #[serde(deserialize_with = "lenient::string_list")]
    pub name: Vec<String>,
    /// Weight format: `auto` keeps what the file has, within what the backend supports;
    /// `native` forces the file's own format; `q8_0`, `f32` (CPU only).
    pub weights: WeightFormat,
    /// Tensor-parallel degree (number of `TpWorker`s).
    pub tp: usize,
    /// Where the forward pass runs: `cpu`, `cuda` (GPU 0) or `cuda:N` (TP rank `r` on GPU
    /// `N + r`). CUDA needs a binary built with `--features cuda` and an NVIDIA driver.
    #[serde(deserialize_with = "lenient::string")]
    pub device: String,
    /// Matmul weight type on CUDA, one of [`CUDA_DTYPES`] (`auto` = f16; weights are
    /// dequantized to it at load). The CPU backend's in-memory format is `weights`.
    pub dtype: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            source: DEFAULT_MODEL_SOURCE.into(),
            mmproj: None,
            name: Vec::new(),
            weights: WeightFormat::Auto,
            tp: 1,
            device: "cpu".into(),
            dtype: "auto".into(),
        }
    }
}

/// Most aliases in `model.name` (`--served-model-name`).
pub const MAX_SERVED_MODEL_NAMES: usize = 64;

/// Largest `server.max_connections` / `proxy.max_connections` (each connection holds a
/// descriptor and a task).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// `[server]`: the OpenAI-compatible HTTP frontend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to bind.
    #[serde(deserialize_with = "lenient::string")]
    pub host: String,
    /// Port to bind.
    pub port: u16,
    /// When set, requests must carry `Authorization: Bearer <api_key>`.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub api_key: Option<String>,
    /// Admission bound: requests in flight (running, and waiting for a batch slot or blocks)
    /// past which new ones are answered 503 with `Retry-After` at once.
    pub max_concurrent_requests: usize,
    /// Open connections the API serves at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Seconds a client has to send a request's whole header (and to finish a TLS
    /// handshake); an idle keep-alive connection is closed after as long.
    pub header_read_timeout_s: u64,
    /// A request still unfinished after this many seconds is aborted.
    pub request_timeout_s: u64,
    /// Bound on one call between the instance's actors (a scheduler query, a lease call
    /// answered by the scheduler), in milliseconds.
    pub actor_call_timeout_ms: u64,
    /// When the instance stops (SIGTERM, Ctrl-C): how long it lets running requests and
    /// KV hand-offs finish before cutting them off, in seconds.
    pub drain_timeout_s: u64,
    /// PEM certificate chain (leaf first): with `tls_key`, the API serves HTTPS only.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_cert: Option<String>,
    /// PEM private key of `tls_cert`.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_key: Option<String>,
    /// PEM CA certificate(s) trusted, beside the system's roots, when this instance calls
    /// other instances over `https://`.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_ca: Option<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            max_concurrent_requests: 256,
            max_connections: 4096,
            header_read_timeout_s: 30,
            request_timeout_s: 600,
            actor_call_timeout_ms: 5_000,
            drain_timeout_s: 30,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

/// `[scheduler]`: batching limits and the paged KV cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most sequences in one running batch.
    pub max_num_seqs: usize,
    /// Most tokens (prompt chunks + decode tokens) in one step.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block: a power of two in `1..=256`.
    pub block_size: usize,
    /// KV blocks per TP rank; `None` derives it from `kv_cache_bytes`.
    pub num_blocks: Option<usize>,
    /// KV cache budget in bytes per TP rank, used when `num_blocks` is `None`.
    pub kv_cache_bytes: u64,
    /// Element type of the KV cache: `f32`, `f16` or `bf16` (half the memory and half the
    /// bytes each P/D hand-off moves). Both sides of a hand-off must agree.
    pub kv_cache_dtype: KvCacheDtype,
    /// Fraction of blocks kept free for running sequences when admitting new ones,
    /// in `[0, 0.5)`.
    pub watermark: f64,
    /// Longest prompt + output; `None` uses the model's context length.
    pub max_model_len: Option<usize>,
    /// Keep computed KV blocks in a prefix cache and reuse them for requests sharing a
    /// prompt prefix; on a decode instance, only the blocks it lacks are transferred
    /// (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
    /// Messages waiting for the Scheduler past which new work (a request from the API, a
    /// prompt from a decode peer) is refused as overloaded (503) instead of queued; the
    /// Scheduler's own traffic (step replies, worker events, timers) is never refused.
    pub mailbox_capacity: usize,
}

/// Largest `scheduler.mailbox_capacity`.
pub const MAX_MAILBOX_CAPACITY: usize = 1 << 20;

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            block_size: 16,
            num_blocks: None,
            kv_cache_bytes: 512 << 20,
            kv_cache_dtype: KvCacheDtype::F32,
            watermark: 0.01,
            max_model_len: None,
            prefix_cache: true,
            mailbox_capacity: 4096,
        }
    }
}

/// `[kv_tiers]`: KV cache tiers below each instance's block pool (issue 30). Blocks the
/// prefix cache evicts are copied into a host spill region (LRU by bytes), whose evictions
/// move on to files in `disk_dir` (LRU by bytes, verified by checksum on every read and at
/// start); a later prompt sharing the prefix restores them instead of computing them. With
/// `shared_dir`, every evicted block is also written to a directory that other instances
/// read and write (a shared store), so one instance restores what another computed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTiersConfig {
    /// Turns the tiers on (needs `scheduler.prefix_cache`).
    pub enabled: bool,
    /// Bytes of the host spill region (0: no host tier; evicted blocks go straight to disk).
    pub host_capacity_bytes: u64,
    /// Directory of the disk tier (unset: no disk tier). Files go in a subdirectory named by
    /// the compatibility key's hash, so instances of other models or layouts never share.
    pub disk_dir: Option<String>,
    /// Bytes of the disk tier.
    pub disk_capacity_bytes: u64,
    /// Directory of the shared store that several instances read and write (unset: none):
    /// one host's instances, or a filesystem mounted on every host. Same subdirectory
    /// scheme as the disk tier; must differ from `disk_dir`.
    pub shared_dir: Option<String>,
    /// The shared store on a Redis or Valkey server instead of a directory:
    /// `redis://HOST:PORT/DB` or `redis+unix:///PATH` (unset: none). Exclusive with
    /// `shared_dir`.
    pub shared_url: Option<String>,
    /// Bytes this instance lets the shared store hold (LRU among the blocks it wrote; give
    /// every instance the same value).
    pub shared_capacity_bytes: u64,
    /// Which evicted blocks are written: `write_back` (all) or `selective`.
    pub write_policy: TierWritePolicy,
    /// With `write_policy = "selective"`: prefix-cache hits a block needs to be written.
    pub selective_min_hits: u32,
    /// Milliseconds a request waits for its blocks to load from the tiers; past that it is
    /// computed without them and the disk tier turns itself off for 30 s.
    pub load_timeout_ms: u64,
    /// Whether a request's restore streams layer by layer: its first step starts once the
    /// blocks are found and computes while the layers are read (false: load, then compute).
    pub stream_layers: bool,
}

impl Default for KvTiersConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            host_capacity_bytes: 1 << 30,
            disk_dir: None,
            disk_capacity_bytes: 16 << 30,
            shared_dir: None,
            shared_url: None,
            shared_capacity_bytes: 64 << 30,
            write_policy: TierWritePolicy::WriteBack,
            selective_min_hits: 2,
            load_timeout_ms: 1000,
            stream_layers: true,
        }
    }
}

use crate::role::Role;

/// `[instance]`: this instance's identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InstanceConfig {
    /// Prefill, decode or both.
    pub role: Role,
    /// Unique name in the cluster (e.g. `instance-0`); no whitespace.
    #[serde(deserialize_with = "lenient::string")]
    pub name: String,
}

impl Default for InstanceConfig {
    fn default() -> Self {
        Self {
            role: Role::Colocated,
            name: "instance-0".into(),
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// `[logging]`: log output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// A `tracing` filter directive (`info`, `pdserve=debug,ractor=warn`, ...);
    /// `RUST_LOG` overrides it when set.
    #[serde(deserialize_with = "lenient::string")]
    pub filter: String,
    /// Line format.
    pub format: LogFormat,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            filter: "info".into(),
            format: LogFormat::Human,
        }
    }
}
