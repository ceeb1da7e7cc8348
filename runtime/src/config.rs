//! The serving configuration: one [`ServeConfig`] tree loaded in layers by figment.
//!
//! Layers, lowest precedence first (a later layer overrides an earlier one key by key):
//!
//! 1. built-in defaults ([`ServeConfig::default`]);
//! 2. a TOML file (`--config FILE`), whose tables are the sections below;
//! 3. the environment: `PDSERVE_<SECTION>__<KEY>` (see [`ENV_PREFIX`], [`ENV_SEPARATOR`]),
//!    e.g. `PDSERVE_SERVER__PORT=9000` or `PDSERVE_SCHEDULER__MAX_NUM_SEQS=8`;
//! 4. command-line flags ([`ServeFlags`], or any partial structure of the same shape).
//!
//! Every struct denies unknown fields, so a misspelt key in any layer is an error that names
//! the key and the layer it came from ([`ConfigError::UnknownKey`]). Only environment variables
//! whose name (after the prefix) contains [`ENV_SEPARATOR`] take part: other `PDSERVE_*`
//! variables used elsewhere (`PDSERVE_HOME`, `PDSERVE_LOG`, `PDSERVE_PYTHON`, ...) are ignored.
//!
//! ```toml
//! [model]
//! source = "synthetic:tiny"
//! tp = 2
//!
//! [server]
//! port = 9000
//!
//! [instance]
//! role = "prefill"
//! ```

use std::fmt;
use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
pub use crate::error::ConfigLayer;

/// Prefix of every environment variable that maps into the config.
pub const ENV_PREFIX: &str = "PDSERVE_";

/// Separator between nesting levels in a config environment variable's name:
/// `PDSERVE_<SECTION>__<KEY>`. Variables without it are not config (e.g. `PDSERVE_HOME`).
pub const ENV_SEPARATOR: &str = "__";

/// The name of the environment variable that sets a dotted config key.
///
/// `env_var_name("server.port") == "PDSERVE_SERVER__PORT"`.
pub fn env_var_name(key: &str) -> String {
    let upper: Vec<String> = key.split('.').map(str::to_ascii_uppercase).collect();
    format!("{ENV_PREFIX}{}", upper.join(ENV_SEPARATOR))
}

/// A config value that names none of its key's accepted values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} must be one of {}, got `{value}`", .expected.join(", "))]
pub struct UnknownValue {
    /// The dotted key (`transfer.backend`).
    pub key: &'static str,
    /// The value given.
    pub value: String,
    /// The accepted values.
    pub expected: &'static [&'static str],
}

/// A closed set of lowercase names for one config key: the enum, its `as_str`/`ALL`/`NAMES`,
/// `Display`, `FromStr` (the accepted names, plus any listed alias) and serde (the same
/// names; a bad one is refused when the config is parsed, with [`UnknownValue`]'s message).
macro_rules! config_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident for $key:literal {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $text:literal $(| $alias:literal)*,
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in a stable order.
            pub const ALL: [$name; <[&str]>::len(&[$($text),+])] = [$(Self::$variant),+];
            /// The accepted names, in the order of [`Self::ALL`].
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name used in config, flags, logs and metrics.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;

            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                match s {
                    $($text $(| $alias)* => Ok(Self::$variant),)+
                    other => Err(UnknownValue {
                        key: $key,
                        value: other.to_string(),
                        expected: Self::NAMES,
                    }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                lenient::string(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

config_enum! {
    /// `transfer.backend`: which medium moves KV bytes between instances.
    pub enum TransferBackend for "transfer.backend" {
        /// Both ends in one process; a transfer is a memcpy.
        Local = "local",
        /// Two processes on one host; regions are memfds the peer maps; a transfer is a memcpy.
        #[default]
        Shm = "shm",
        /// Tokio TCP sockets, several parallel connections per peer.
        Tcp = "tcp",
        /// QUIC (quinn) streams, mutual TLS from the cluster CA.
        Quic = "quic",
        /// One-sided RDMA READ/WRITE (ibverbs, cargo feature `rdma`).
        Rdma = "rdma",
    }
}

config_enum! {
    /// `transfer.mode`: how KV moves from prefill to decode when the decode instance drives
    /// the hand-off.
    pub enum TransferMode for "transfer.mode" {
        /// vLLM NIXL style: prefill finishes and holds the blocks under a lease; decode reads
        /// them and releases the lease.
        #[default]
        Pull = "pull",
        /// Mooncake/SGLang style: decode sends its destination blocks with the prompt; prefill
        /// writes each layer's blocks as soon as that layer is computed.
        Push = "push",
    }
}

config_enum! {
    /// `model.weights`: the in-memory weight format of the CPU backend.
    pub enum WeightFormat for "model.weights" {
        /// Sub-8-bit quantized weights (Q4_*, Q5_*, k-quants) are requantized to Q8_0 at load
        /// and run on candle's VNNI-packed Q8_0 kernels: the fastest CPU path. Everything else
        /// stays as stored.
        #[default]
        Auto = "auto",
        /// Exactly as stored in the file. Q4_0, Q4_1, Q8_0, Q4_K and Q6_K run on pdserve's own
        /// llama.cpp-exact kernels (llama.cpp's numerics and greedy tokens; tensor-parallel
        /// runs give tp=1's logits bit for bit): about twice `auto`'s batch-1 decode, ~0.85×
        /// its prefill. Other formats run on candle's.
        Native = "native",
        /// Q8_0 wherever the row length allows it (`q8` is accepted as an alias).
        Q8_0 = "q8_0" | "q8",
        /// Dequantized to f32.
        F32 = "f32",
    }
}

config_enum! {
    /// `scheduler.kv_cache_dtype`: the element type of the KV cache (part of the layout both
    /// sides of a hand-off must share).
    pub enum KvCacheDtype for "scheduler.kv_cache_dtype" {
        /// 32-bit floats: what attention computes with.
        #[default]
        F32 = "f32",
        /// IEEE half precision: half the memory and half the hand-off bytes.
        F16 = "f16",
        /// bfloat16: as f16, with f32's range and 8 mantissa bits.
        Bf16 = "bf16",
    }
}

/// Devices accepted by `model.device` (besides `cuda:N`, a GPU by ordinal).
pub const DEVICES: &[&str] = &["cpu", "cuda"];

/// CUDA matmul weight types accepted by `model.dtype`.
pub const CUDA_DTYPES: &[&str] = &["auto", "f16", "bf16", "f32"];

/// Whether `s` names a device `model.device` accepts: `cpu`, `cuda` or `cuda:N`.
pub fn is_device(s: &str) -> bool {
    DEVICES.contains(&s)
        || s.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The default model source: the built-in default model (SmolLM2-135M-Instruct).
pub const DEFAULT_MODEL_SOURCE: &str = "default";

/// Prefix of a synthetic model source: `synthetic:NAME`.
pub const SYNTHETIC_MODEL_PREFIX: &str = "synthetic:";

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
}

impl Default for ControlSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            proxy: None,
            heartbeat_ms: 500,
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
}

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
        }
    }
}

pub use crate::role::Role;

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

/// The command-line flags that override config keys: every field is optional and only the
/// ones set are applied (the top layer of [`ServeConfig::load`]).
///
/// It serializes into the config's nested shape (`tp` becomes `model.tp`, `port` becomes
/// `server.port`, ...), so it can be passed to [`ServeConfig::load`] as is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeFlags {
    /// `model.source`.
    pub model: Option<String>,
    /// `model.name` (aliases; empty: not set).
    pub served_model_name: Vec<String>,
    /// `model.tp`.
    pub tp: Option<usize>,
    /// `model.weights`.
    pub weights: Option<String>,
    /// `model.device`.
    pub device: Option<String>,
    /// `model.dtype`.
    pub dtype: Option<String>,
    /// `server.host`.
    pub host: Option<String>,
    /// `server.port`.
    pub port: Option<u16>,
    /// `server.api_key`.
    pub api_key: Option<String>,
    /// `server.tls_cert`.
    pub tls_cert: Option<String>,
    /// `server.tls_key`.
    pub tls_key: Option<String>,
    /// `server.tls_ca`.
    pub tls_ca: Option<String>,
    /// `instance.role`.
    pub role: Option<Role>,
    /// `instance.name`.
    pub name: Option<String>,
    /// `scheduler.max_num_seqs`.
    pub max_num_seqs: Option<usize>,
    /// `scheduler.max_num_batched_tokens`.
    pub max_num_batched_tokens: Option<usize>,
    /// `scheduler.block_size`.
    pub block_size: Option<usize>,
    /// `scheduler.num_blocks`.
    pub num_blocks: Option<usize>,
    /// `scheduler.kv_cache_dtype`.
    pub kv_cache_dtype: Option<String>,
    /// `scheduler.prefix_cache`.
    pub prefix_cache: Option<bool>,
    /// `logging.filter`.
    pub log_filter: Option<String>,
    /// `logging.format`.
    pub log_format: Option<LogFormat>,
    /// `transfer.backend`.
    pub transfer: Option<String>,
    /// `transfer.listen`.
    pub transfer_listen: Option<String>,
    /// `transfer.credentials_dir`.
    pub credentials_dir: Option<String>,
    /// `transfer.mode`.
    pub transfer_mode: Option<String>,
    /// `transfer.min_remote_prompt_tokens`.
    pub min_remote_prompt_tokens: Option<usize>,
    /// `transfer.advertise_addr`.
    pub transfer_advertise_addr: Option<String>,
    /// `transfer.io_threads`.
    pub transfer_io_threads: Option<usize>,
    /// `transfer.memcpy_threads`.
    pub transfer_memcpy_threads: Option<usize>,
    /// `transfer.queue_depth`.
    pub transfer_queue_depth: Option<usize>,
    /// `transfer.piece_bytes`.
    pub transfer_piece_bytes: Option<u64>,
    /// `transfer.tcp_connections`.
    pub transfer_tcp_connections: Option<usize>,
    /// `transfer.registration_chunk_bytes`.
    pub transfer_registration_chunk_bytes: Option<u64>,
    /// `transfer.require_auth`.
    pub transfer_require_auth: Option<bool>,
    /// `transfer.tcp_integrity`.
    pub transfer_tcp_integrity: Option<String>,
    /// `transfer.rdma_devices`.
    pub rdma_devices: Option<String>,
    /// `transfer.rdma_port`.
    pub rdma_port: Option<u8>,
    /// `transfer.rdma_gid_index`.
    pub rdma_gid_index: Option<u32>,
    /// `transfer.rdma_mtu`.
    pub rdma_mtu: Option<u32>,
    /// `transfer.rdma_send_queue_depth`.
    pub rdma_send_queue_depth: Option<u32>,
    /// `transfer.rdma_cq_depth`.
    pub rdma_cq_depth: Option<u32>,
    /// `control.listen`.
    pub control_listen: Option<String>,
    /// `control.proxy`.
    pub control_proxy: Option<String>,
    /// `server.drain_timeout_s`.
    pub drain_timeout_s: Option<u64>,
}

/// The nested shape [`ServeFlags`] serializes into.
#[derive(Serialize)]
struct FlagsTree<'a> {
    model: FlagsModel<'a>,
    server: FlagsServer<'a>,
    scheduler: FlagsScheduler<'a>,
    instance: FlagsInstance<'a>,
    logging: FlagsLogging<'a>,
    transfer: FlagsTransfer<'a>,
    control: FlagsControl<'a>,
}

#[derive(Serialize)]
struct FlagsControl<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<&'a str>,
}

#[derive(Serialize)]
struct FlagsTransfer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    credentials_dir: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_remote_prompt_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    advertise_addr: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    io_threads: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memcpy_threads: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    queue_depth: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    piece_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tcp_connections: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    registration_chunk_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    require_auth: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tcp_integrity: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_devices: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_port: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_gid_index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_mtu: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_send_queue_depth: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma_cq_depth: Option<u32>,
}

#[derive(Serialize)]
struct FlagsModel<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<&'a str>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    name: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    weights: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tp: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dtype: Option<&'a str>,
}

#[derive(Serialize)]
struct FlagsServer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    host: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_cert: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls_ca: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    drain_timeout_s: Option<u64>,
}

#[derive(Serialize)]
struct FlagsScheduler<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    max_num_seqs: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_num_batched_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    block_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_blocks: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_cache_dtype: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prefix_cache: Option<bool>,
}

#[derive(Serialize)]
struct FlagsInstance<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<Role>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

#[derive(Serialize)]
struct FlagsLogging<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    filter: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    format: Option<LogFormat>,
}

impl Serialize for ServeFlags {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        FlagsTree {
            model: FlagsModel {
                source: self.model.as_deref(),
                name: &self.served_model_name,
                weights: self.weights.as_deref(),
                tp: self.tp,
                device: self.device.as_deref(),
                dtype: self.dtype.as_deref(),
            },
            server: FlagsServer {
                host: self.host.as_deref(),
                port: self.port,
                api_key: self.api_key.as_deref(),
                tls_cert: self.tls_cert.as_deref(),
                tls_key: self.tls_key.as_deref(),
                tls_ca: self.tls_ca.as_deref(),
                drain_timeout_s: self.drain_timeout_s,
            },
            scheduler: FlagsScheduler {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                block_size: self.block_size,
                num_blocks: self.num_blocks,
                kv_cache_dtype: self.kv_cache_dtype.as_deref(),
                prefix_cache: self.prefix_cache,
            },
            instance: FlagsInstance {
                role: self.role,
                name: self.name.as_deref(),
            },
            logging: FlagsLogging {
                filter: self.log_filter.as_deref(),
                format: self.log_format,
            },
            transfer: FlagsTransfer {
                backend: self.transfer.as_deref(),
                listen: self.transfer_listen.as_deref(),
                credentials_dir: self.credentials_dir.as_deref(),
                mode: self.transfer_mode.as_deref(),
                min_remote_prompt_tokens: self.min_remote_prompt_tokens,
                advertise_addr: self.transfer_advertise_addr.as_deref(),
                io_threads: self.transfer_io_threads,
                memcpy_threads: self.transfer_memcpy_threads,
                queue_depth: self.transfer_queue_depth,
                piece_bytes: self.transfer_piece_bytes,
                tcp_connections: self.transfer_tcp_connections,
                registration_chunk_bytes: self.transfer_registration_chunk_bytes,
                require_auth: self.transfer_require_auth,
                tcp_integrity: self.transfer_tcp_integrity.as_deref(),
                rdma_devices: self.rdma_devices.as_deref(),
                rdma_port: self.rdma_port,
                rdma_gid_index: self.rdma_gid_index,
                rdma_mtu: self.rdma_mtu,
                rdma_send_queue_depth: self.rdma_send_queue_depth,
                rdma_cq_depth: self.rdma_cq_depth,
            },
            control: FlagsControl {
                listen: self.control_listen.as_deref(),
                proxy: self.control_proxy.as_deref(),
            },
        }
        .serialize(serializer)
    }
}

/// Deserializers for free-text fields: figment parses environment values, so
/// `PDSERVE_SERVER__API_KEY=12345` arrives as a number; these accept integers and booleans
/// as their decimal/`true`/`false` text. Floats are refused (their text would not round-trip:
/// quote them, `PDSERVE_INSTANCE__NAME='"1.50"'`).
mod lenient {
    use std::fmt;

    use serde::de::{self, Deserializer, Visitor};

    struct Text;

    impl Visitor<'_> for Text {
        type Value = String;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
            Ok(v.to_owned())
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
            Ok(v)
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_i128<E: de::Error>(self, v: i128) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_u128<E: de::Error>(self, v: u128) -> Result<String, E> {
            Ok(v.to_string())
        }
    }

    struct OptText;

    impl<'de> Visitor<'de> for OptText {
        type Value = Option<String>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(Text).map(Some)
        }
    }

    pub(super) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        d.deserialize_any(Text)
    }

    struct TextList;

    impl<'de> Visitor<'de> for TextList {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or a list of strings")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(TextList)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Text.visit_str(v).map(|s| vec![s])
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(vec![v])
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Text.visit_bool(v).map(|s| vec![s])
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Text.visit_i64(v).map(|s| vec![s])
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Text.visit_u64(v).map(|s| vec![s])
        }
        fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
            Text.visit_i128(v).map(|s| vec![s])
        }
        fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
            Text.visit_u128(v).map(|s| vec![s])
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element_seed(TextSeed)? {
                out.push(s);
            }
            Ok(out)
        }
    }

    /// One element of a [`TextList`], as leniently typed as [`Text`].
    struct TextSeed;

    impl<'de> de::DeserializeSeed<'de> for TextSeed {
        type Value = String;

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
            d.deserialize_any(Text)
        }
    }

    /// One string (a single-element list) or a list of strings.
    pub(super) fn string_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        d.deserialize_any(TextList)
    }

    pub(super) fn opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_option(OptText)
    }
}

/// The name of the proxy's section (`[proxy]`, `PDSERVE_PROXY__<KEY>`).
pub const PROXY_SECTION: &str = "proxy";

/// The environment variable of `proxy.api_key` under its older name, still read when
/// `PDSERVE_PROXY__API_KEY` is not set (`pdserve launch` passes the key to its proxy there).
pub const PROXY_API_KEY_ENV: &str = "PDSERVE_PROXY_API_KEY";

/// The configuration of `pdserve proxy`: the same layers as an instance's (defaults < TOML
/// `--config` file < `PDSERVE_PROXY__<KEY>` / `PDSERVE_LOGGING__<KEY>` < flags).
///
/// ```toml
/// [proxy]
/// port = 8000
/// prefill = ["http://10.0.0.2:8100"]
/// decode = ["http://10.0.0.3:8200"]
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// The proxy.
    pub proxy: ProxySection,
    /// Log output.
    pub logging: LoggingConfig,
}

/// `[proxy]`: the P/D front door.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxySection {
    /// Address to bind.
    #[serde(deserialize_with = "lenient::string")]
    pub host: String,
    /// Port to bind (0 picks one).
    pub port: u16,
    /// Static prefill instances (`http://host:port`), polled for their load.
    pub prefill: Vec<String>,
    /// Static decode instances.
    pub decode: Vec<String>,
    /// Bound on each upstream call, in seconds.
    pub timeout_s: u64,
    /// Conditional disaggregation: when the least-loaded prefill instance has more requests
    /// queued or running than this, the decode instance prefills the request itself.
    pub max_prefill_queue: Option<usize>,
    /// Admission bound: requests the proxy forwards at once; one more is answered 503 with
    /// `Retry-After` before anything is sent upstream.
    pub max_concurrent_requests: usize,
    /// Open client connections served at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Seconds a client has to send a request's whole header (and to finish a TLS
    /// handshake); an idle keep-alive connection is closed after as long.
    pub header_read_timeout_s: u64,
    /// Bearer token clients must send on `/v1/*` (and that the proxy sends on to instances).
    #[serde(deserialize_with = "lenient::opt_string")]
    pub api_key: Option<String>,
    /// Cluster credentials directory: enables the control plane, where instances register and
    /// `pdserve inspect` connects.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub credentials_dir: Option<String>,
    /// Member name of this proxy in the credentials directory.
    #[serde(deserialize_with = "lenient::string")]
    pub node: String,
    /// Control-plane listen address (UDP; port 0 picks one).
    #[serde(deserialize_with = "lenient::string")]
    pub control_listen: String,
    /// Bound on one call between the proxy's actors, in milliseconds.
    pub actor_call_timeout_ms: u64,
    /// PEM certificate chain (leaf first): with `tls_key`, the proxy serves HTTPS only.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_cert: Option<String>,
    /// PEM private key of `tls_cert`.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_key: Option<String>,
    /// PEM CA certificate(s) trusted, beside the system's roots, for `https://` instances.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub tls_ca: Option<String>,
    /// Times one request may move to another decode instance when the one serving it dies or
    /// its stream breaks mid-generation (request migration); 0 turns migration off.
    pub migration_limit: u32,
    /// What the proxy does when the prefill instance of a request fails before the hand-off.
    pub prefill_retry: PrefillRetry,
    /// How the proxy picks instances: `kv` (prefix overlap and load), `least-loaded` or
    /// `round-robin`.
    pub router: RouterKind,
    /// The model whose tokenizer (and chat template) the KV router uses to hash text and chat
    /// prompts: a GGUF path, an HF directory, `default` or `synthetic:...`. Without it only
    /// token-id prompts are matched against the instances' caches.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub model: Option<String>,
    /// Weight of prefill work against decode load in the KV router's cost.
    pub prefill_load_scale: f64,
    /// Bound on the block hashes the proxy indexes per instance.
    pub kv_index_max_blocks: usize,
}

/// How the proxy picks a request's instances (`proxy.router`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    /// Lowest cost: prefill blocks left to compute after the cached-prefix overlap, plus
    /// load (Dynamo's formula).
    #[default]
    Kv,
    /// Fewest queued + running requests, then most free blocks.
    LeastLoaded,
    /// In turn, whatever their load.
    RoundRobin,
}

impl RouterKind {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::LeastLoaded => "least-loaded",
            Self::RoundRobin => "round-robin",
        }
    }
}

impl std::str::FromStr for RouterKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kv" => Ok(Self::Kv),
            "least-loaded" => Ok(Self::LeastLoaded),
            "round-robin" => Ok(Self::RoundRobin),
            other => Err(format!(
                "unknown router `{other}` (expected kv, least-loaded or round-robin)"
            )),
        }
    }
}

/// What the proxy does when a request's prefill instance fails before the KV hand-off
/// (`proxy.prefill_retry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillRetry {
    /// Another prefill instance; when none is left, the decode instance prefills itself.
    #[default]
    Retry,
    /// The decode instance prefills the request itself.
    Local,
    /// The error goes to the client.
    Fail,
}

impl PrefillRetry {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Local => "local",
            Self::Fail => "fail",
        }
    }
}

impl Default for ProxySection {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            prefill: Vec::new(),
            decode: Vec::new(),
            timeout_s: 600,
            max_prefill_queue: None,
            max_concurrent_requests: 1024,
            max_connections: 4096,
            header_read_timeout_s: 30,
            api_key: None,
            credentials_dir: None,
            node: "proxy".into(),
            control_listen: "127.0.0.1:0".into(),
            actor_call_timeout_ms: 5_000,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            migration_limit: 1,
            prefill_retry: PrefillRetry::Retry,
            router: RouterKind::Kv,
            model: None,
            prefill_load_scale: 1.0,
            kv_index_max_blocks: 1 << 20,
        }
    }
}

impl ProxyConfig {
    /// Loads the proxy's config: built-in defaults < TOML `file` < `PDSERVE_PROXY__<KEY>` and
    /// `PDSERVE_LOGGING__<KEY>` < `flags` (a partial structure of the same shape, `None`
    /// fields skipped), then validates it.
    ///
    /// # Errors
    ///
    /// As [`ServeConfig::load`].
    pub fn load(file: Option<&Path>, flags: impl Serialize) -> Result<ProxyConfig, ConfigError> {
        let figment = layered(ProxyConfig::default(), file, flags, |section| {
            section == PROXY_SECTION || section == "logging"
        })?;
        let mut config: ProxyConfig = extract_validated(&figment, ProxyConfig::validate)?;
        if config.proxy.api_key.is_none() {
            config.proxy.api_key = std::env::var(PROXY_API_KEY_ENV)
                .ok()
                .filter(|k| !k.is_empty());
        }
        Ok(config)
    }

    /// Checks the values.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] naming the first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message,
                layer: None,
            })
        };
        let p = &self.proxy;
        if format!("{}:{}", p.host, p.port)
            .parse::<std::net::SocketAddr>()
            .is_err()
        {
            return invalid(
                "proxy.host",
                format!("proxy.host must be an IP address, got `{}`", p.host),
            );
        }
        if p.timeout_s == 0 {
            return invalid("proxy.timeout_s", "proxy.timeout_s must be > 0".into());
        }
        if p.max_concurrent_requests == 0 {
            return invalid(
                "proxy.max_concurrent_requests",
                "proxy.max_concurrent_requests must be ≥ 1".into(),
            );
        }
        if !(1..=MAX_CONNECTIONS).contains(&p.max_connections) {
            return invalid(
                "proxy.max_connections",
                format!(
                    "proxy.max_connections must be 1..={MAX_CONNECTIONS}, got {}",
                    p.max_connections
                ),
            );
        }
        if !(1..=3600).contains(&p.header_read_timeout_s) {
            return invalid(
                "proxy.header_read_timeout_s",
                format!(
                    "proxy.header_read_timeout_s must be 1..=3600, got {}",
                    p.header_read_timeout_s
                ),
            );
        }
        if !(p.prefill_load_scale.is_finite() && p.prefill_load_scale >= 0.0) {
            return invalid(
                "proxy.prefill_load_scale",
                format!(
                    "proxy.prefill_load_scale must be a finite number >= 0, got {}",
                    p.prefill_load_scale
                ),
            );
        }
        if p.kv_index_max_blocks == 0 {
            return invalid(
                "proxy.kv_index_max_blocks",
                "proxy.kv_index_max_blocks must be > 0".into(),
            );
        }
        if p.actor_call_timeout_ms == 0 {
            return invalid(
                "proxy.actor_call_timeout_ms",
                "proxy.actor_call_timeout_ms must be > 0".into(),
            );
        }
        if p.control_listen.parse::<std::net::SocketAddr>().is_err() {
            return invalid(
                "proxy.control_listen",
                format!(
                    "proxy.control_listen must be an IP:port, got `{}`",
                    p.control_listen
                ),
            );
        }
        for (key, urls) in [("proxy.prefill", &p.prefill), ("proxy.decode", &p.decode)] {
            if let Some(u) = urls
                .iter()
                .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
            {
                return invalid(key, format!("{key}: `{u}` is not an http:// URL"));
            }
        }
        if p.api_key.as_deref().is_some_and(str::is_empty) {
            return invalid(
                "proxy.api_key",
                "proxy.api_key must not be empty when set".into(),
            );
        }
        check_tls("proxy", [&p.tls_cert, &p.tls_key, &p.tls_ca])?;
        Ok(())
    }
}

const LAYER_DEFAULTS: &str = "built-in defaults";
const LAYER_ENV: &str = "environment";
const LAYER_FLAGS: &str = "command-line flags";

/// A provider under a name of ours, so errors can say which layer a key came from.
struct NamedLayer<P> {
    name: &'static str,
    inner: P,
}

impl<P: Provider> Provider for NamedLayer<P> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

/// The layered figment of a config whose built-in values are `defaults`: defaults < TOML
/// `file` < `PDSERVE_<SECTION>__<KEY>` environment < `flags`.
/// `SECTION.tls_cert` and `SECTION.tls_key` come together, and no TLS path is empty. (Whether
/// the files hold a certificate and its key is checked when the server starts.)
fn check_tls(section: &str, [cert, key, ca]: [&Option<String>; 3]) -> Result<(), ConfigError> {
    let invalid = |name: &str, message: String| {
        Err(ConfigError::Invalid {
            key: format!("{section}.{name}"),
            message,
            layer: None,
        })
    };
    for (name, value) in [("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            return invalid(name, format!("{section}.{name} must not be empty when set"));
        }
    }
    match (cert, key) {
        (Some(_), None) => invalid(
            "tls_key",
            format!("{section}.tls_cert is set but {section}.tls_key is not: HTTPS needs both"),
        ),
        (None, Some(_)) => invalid(
            "tls_cert",
            format!("{section}.tls_key is set but {section}.tls_cert is not: HTTPS needs both"),
        ),
        _ => Ok(()),
    }
}

fn layered(
    defaults: impl Serialize,
    file: Option<&Path>,
    flags: impl Serialize,
    env_sections: impl Fn(&str) -> bool + Clone + Send + Sync + 'static,
) -> Result<Figment, ConfigError> {
    let mut figment = Figment::from(NamedLayer {
        name: LAYER_DEFAULTS,
        inner: Serialized::defaults(defaults),
    });
    if let Some(path) = file {
        // `Toml::file` silently treats a missing file as empty; an explicit `--config`
        // that does not exist is a mistake the user must hear about.
        if let Err(err) = std::fs::metadata(path).and_then(|m| {
            if m.is_file() {
                Ok(())
            } else {
                Err(std::io::Error::other("not a regular file"))
            }
        }) {
            return Err(ConfigError::File {
                path: path.to_path_buf(),
                message: err.to_string(),
            });
        }
        figment = figment.merge(Toml::file_exact(path));
    }
    let env = Env::prefixed(ENV_PREFIX)
        .filter(move |key| {
            key.as_str()
                .split_once(ENV_SEPARATOR)
                .is_some_and(|(section, _)| env_sections(&section.to_ascii_lowercase()))
        })
        .split(ENV_SEPARATOR);
    figment = figment
        .merge(NamedLayer {
            name: LAYER_ENV,
            inner: env,
        })
        .merge(NamedLayer {
            name: LAYER_FLAGS,
            inner: Serialized::defaults(flags),
        });
    Ok(figment)
}

/// Extracts a config from `figment` and checks it with `validate`, naming the layer of the
/// offending key.
fn extract_validated<T: serde::de::DeserializeOwned>(
    figment: &Figment,
    validate: impl FnOnce(&T) -> Result<(), ConfigError>,
) -> Result<T, ConfigError> {
    let config: T = figment
        .extract()
        .map_err(|err| convert_error(figment, err))?;
    validate(&config).map_err(|err| match err {
        ConfigError::Invalid {
            key,
            message,
            layer: None,
        } => {
            let layer = layer_of(figment, &key);
            ConfigError::Invalid {
                key,
                message,
                layer,
            }
        }
        other => other,
    })?;
    Ok(config)
}

impl ServeConfig {
    /// Builds the layered figment (defaults < `file` < environment < `flags`) without
    /// extracting it; use [`ServeConfig::from_figment`] to extract, or merge more providers
    /// first.
    ///
    /// `flags` is any serializable partial structure of the config's shape (usually
    /// [`ServeFlags`]); `None` fields must be skipped, not serialized as null.
    ///
    /// # Errors
    ///
    /// [`ConfigError::File`] when `file` is given but is not a readable file.
    pub fn figment(file: Option<&Path>, flags: impl Serialize) -> Result<Figment, ConfigError> {
        // Every section but the proxy's: a misspelt section is an error that names it.
        layered(ServeConfig::default(), file, flags, |section| {
            section != PROXY_SECTION
        })
    }

    /// Extracts and validates a config from `figment` (usually from [`ServeConfig::figment`]).
    ///
    /// # Errors
    ///
    /// [`ConfigError::UnknownKey`] or [`ConfigError::InvalidValue`] when a layer holds a key
    /// the config does not have or a value of the wrong type (the error names the key and the
    /// layer); [`ConfigError::Invalid`] when [`ServeConfig::validate`] rejects the result.
    pub fn from_figment(figment: &Figment) -> Result<ServeConfig, ConfigError> {
        extract_validated(figment, ServeConfig::validate)
    }

    /// Loads the config: built-in defaults < TOML `file` < `PDSERVE_<SECTION>__<KEY>`
    /// environment variables < `flags`, then validates it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::File`] when `file` cannot be read; [`ConfigError::UnknownKey`],
    /// [`ConfigError::InvalidValue`] or [`ConfigError::Parse`] when a layer is wrong;
    /// [`ConfigError::Invalid`] when the merged config fails [`ServeConfig::validate`].
    pub fn load(file: Option<&Path>, flags: impl Serialize) -> Result<ServeConfig, ConfigError> {
        Self::from_figment(&Self::figment(file, flags)?)
    }

    /// Checks the values' ranges and their consistency.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] naming the first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(key: &str, message: impl Into<String>) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid {
                key: key.into(),
                message: message.into(),
                layer: None,
            })
        }
        if let Some((key, message)) = self.faults.invalid() {
            return invalid(key, message);
        }
        if !self.instance.role.is_instance() {
            return invalid(
                "instance.role",
                format!(
                    "instance.role must be colocated, prefill or decode, got `{}`",
                    self.instance.role
                ),
            );
        }
        if self.transfer.timeout_s == 0 {
            return invalid("transfer.timeout_s", "transfer.timeout_s must be > 0");
        }
        if let Some((key, message)) = self.transfer.invalid() {
            return invalid(key, message);
        }
        if self
            .transfer
            .listen
            .parse::<std::net::SocketAddr>()
            .is_err()
        {
            return invalid(
                "transfer.listen",
                format!(
                    "transfer.listen must be an IP:port, got `{}`",
                    self.transfer.listen
                ),
            );
        }
        if self.transfer.kv_lease_s == 0 {
            return invalid("transfer.kv_lease_s", "transfer.kv_lease_s must be > 0");
        }
        let ctl = &self.control;
        if ctl.listen.parse::<std::net::SocketAddr>().is_err() {
            return invalid(
                "control.listen",
                format!("control.listen must be an IP:port, got `{}`", ctl.listen),
            );
        }
        if let Some(proxy) = &ctl.proxy {
            match proxy.parse::<std::net::SocketAddr>() {
                Ok(a) if a.port() != 0 => {}
                _ => {
                    return invalid(
                        "control.proxy",
                        format!(
                        "control.proxy must be the proxy's control address IP:port, got `{proxy}`"
                    ),
                    )
                }
            }
        }
        if !HEARTBEAT_MS_RANGE.contains(&ctl.heartbeat_ms) {
            return invalid(
                "control.heartbeat_ms",
                format!(
                    "control.heartbeat_ms must be between {} and {}, got {}",
                    HEARTBEAT_MS_RANGE.start(),
                    HEARTBEAT_MS_RANGE.end(),
                    ctl.heartbeat_ms
                ),
            );
        }
        let m = &self.model;
        if m.source.trim().is_empty() {
            return invalid(
                "model.source",
                "model.source must not be empty (use \"default\", a path, or \"synthetic:NAME\")",
            );
        }
        if let Some(name) = m.source.strip_prefix(SYNTHETIC_MODEL_PREFIX) {
            if name.trim().is_empty() {
                return invalid(
                    "model.source",
                    "model.source \"synthetic:NAME\" needs a NAME",
                );
            }
        }
        if m.name.len() > MAX_SERVED_MODEL_NAMES {
            return invalid(
                "model.name",
                format!(
                    "model.name has {} aliases, at most {MAX_SERVED_MODEL_NAMES}",
                    m.name.len()
                ),
            );
        }
        for (i, n) in m.name.iter().enumerate() {
            if n.trim().is_empty() {
                return invalid("model.name", "model.name must not be empty when set");
            }
            if m.name[..i].contains(n) {
                return invalid("model.name", format!("model.name lists {n:?} twice"));
            }
        }
        if m.tp < 1 {
            return invalid("model.tp", "model.tp must be ≥ 1");
        }
        if !is_device(&m.device) {
            return invalid(
                "model.device",
                format!(
                    "model.device must be cpu, cuda or cuda:N, got {:?}",
                    m.device
                ),
            );
        }
        if !CUDA_DTYPES.contains(&m.dtype.as_str()) {
            return invalid(
                "model.dtype",
                format!(
                    "model.dtype must be one of {}, got {:?}",
                    CUDA_DTYPES.join(", "),
                    m.dtype
                ),
            );
        }
        if m.device != "cpu" && m.weights != WeightFormat::Auto {
            return invalid(
                "model.weights",
                format!(
                    "model.weights {:?} is a CPU format; on {} the weight type is model.dtype",
                    m.weights.as_str(),
                    m.device
                ),
            );
        }

        let s = &self.server;
        if s.host.trim().is_empty() {
            return invalid("server.host", "server.host must not be empty");
        }
        // Port 0 (the system picks one) only makes sense when the instance tells a proxy
        // where it ended up: it registers its bound address over the control plane.
        if s.port == 0 && self.control.proxy.is_none() {
            return invalid(
                "server.port",
                "server.port must be > 0 (0, a port the system picks, needs control.proxy: the instance then registers the address it bound)",
            );
        }
        if s.api_key.as_deref().is_some_and(str::is_empty) {
            return invalid(
                "server.api_key",
                "server.api_key must not be empty when set",
            );
        }
        check_tls("server", [&s.tls_cert, &s.tls_key, &s.tls_ca])?;
        if s.max_concurrent_requests == 0 {
            return invalid(
                "server.max_concurrent_requests",
                "server.max_concurrent_requests must be ≥ 1",
            );
        }
        if !(1..=MAX_CONNECTIONS).contains(&s.max_connections) {
            return invalid(
                "server.max_connections",
                format!(
                    "server.max_connections must be 1..={MAX_CONNECTIONS}, got {}",
                    s.max_connections
                ),
            );
        }
        if !(1..=3600).contains(&s.header_read_timeout_s) {
            return invalid(
                "server.header_read_timeout_s",
                format!(
                    "server.header_read_timeout_s must be 1..=3600, got {}",
                    s.header_read_timeout_s
                ),
            );
        }
        if s.actor_call_timeout_ms == 0 {
            return invalid(
                "server.actor_call_timeout_ms",
                "server.actor_call_timeout_ms must be > 0",
            );
        }
        if s.request_timeout_s == 0 {
            return invalid(
                "server.request_timeout_s",
                "server.request_timeout_s must be > 0",
            );
        }

        let c = &self.scheduler;
        if c.max_num_seqs == 0 {
            return invalid(
                "scheduler.max_num_seqs",
                "scheduler.max_num_seqs must be ≥ 1",
            );
        }
        if c.max_num_batched_tokens == 0 {
            return invalid(
                "scheduler.max_num_batched_tokens",
                "scheduler.max_num_batched_tokens must be ≥ 1",
            );
        }
        if c.max_num_batched_tokens < c.max_num_seqs {
            return invalid(
                "scheduler.max_num_batched_tokens",
                format!(
                    "scheduler.max_num_batched_tokens ({}) must be ≥ scheduler.max_num_seqs ({}): \
                     every running sequence needs one token per decode step",
                    c.max_num_batched_tokens, c.max_num_seqs
                ),
            );
        }
        if !(1..=256).contains(&c.block_size) || !c.block_size.is_power_of_two() {
            return invalid(
                "scheduler.block_size",
                format!(
                    "scheduler.block_size must be a power of two between 1 and 256, got {}",
                    c.block_size
                ),
            );
        }
        match c.num_blocks {
            Some(0) => {
                return invalid(
                    "scheduler.num_blocks",
                    "scheduler.num_blocks must be ≥ 1 when set",
                )
            }
            Some(_) => {}
            None if c.kv_cache_bytes == 0 => {
                return invalid(
                    "scheduler.kv_cache_bytes",
                    "scheduler.kv_cache_bytes must be > 0 when scheduler.num_blocks is not set",
                )
            }
            None => {}
        }
        if !(c.watermark.is_finite() && (0.0..0.5).contains(&c.watermark)) {
            return invalid(
                "scheduler.watermark",
                format!(
                    "scheduler.watermark must be in [0, 0.5), got {}",
                    c.watermark
                ),
            );
        }
        if c.max_model_len == Some(0) {
            return invalid(
                "scheduler.max_model_len",
                "scheduler.max_model_len must be ≥ 1 when set",
            );
        }

        let i = &self.instance;
        if i.name.is_empty()
            || i.name
                .chars()
                .any(|ch| ch.is_whitespace() || ch.is_control())
        {
            return invalid(
                "instance.name",
                format!(
                    "instance.name must be non-empty without whitespace, got {:?}",
                    i.name
                ),
            );
        }

        if let Err(err) = tracing_subscriber::EnvFilter::builder().parse(&self.logging.filter) {
            return invalid(
                "logging.filter",
                format!(
                    "logging.filter {:?} is not a valid tracing filter: {err}",
                    self.logging.filter
                ),
            );
        }
        Ok(())
    }
}

/// Which layer set `key` (dotted), as figment recorded it.
fn layer_of(figment: &Figment, key: &str) -> Option<ConfigLayer> {
    let metadata = figment.find_metadata(key)?;
    Some(layer_from_metadata(metadata, key))
}

fn layer_from_metadata(metadata: &Metadata, key: &str) -> ConfigLayer {
    if let Some(figment::Source::File(path)) = &metadata.source {
        return ConfigLayer::File(path.clone());
    }
    match metadata.name.as_ref() {
        LAYER_ENV => ConfigLayer::Env(env_var_name(key)),
        LAYER_FLAGS => ConfigLayer::Flags,
        _ => ConfigLayer::Defaults,
    }
}

/// Turns figment's error (first of its chain) into a [`ConfigError`] naming the key and layer.
fn convert_error(figment: &Figment, err: figment::Error) -> ConfigError {
    use figment::error::Kind;
    let more = err.count().saturating_sub(1);
    // For an unknown field, figment's path already ends with the field's name.
    let key = err.path.join(".");
    // Prefer the provider that actually holds `key`; the error's own tag can point at the
    // enclosing table, which the defaults created.
    let layer = if key.is_empty() {
        None
    } else {
        layer_of(figment, &key)
            .or_else(|| err.metadata.as_ref().map(|m| layer_from_metadata(m, &key)))
    };
    if let Kind::UnknownField(_, expected) = &err.kind {
        let expected = expected.iter().map(|s| (*s).to_owned()).collect();
        return ConfigError::UnknownKey {
            key,
            expected,
            layer,
        };
    }
    let mut message = err.kind.to_string();
    if more > 0 {
        message.push_str(&format!(" (and {more} more error(s))"));
    }
    if key.is_empty() {
        // Syntax errors in a file and the like carry no key path.
        let origin = err
            .metadata
            .as_ref()
            .map(|m| layer_from_metadata(m, "").to_string());
        return ConfigError::Parse {
            message: err.to_string(),
            origin,
        };
    }
    ConfigError::InvalidValue {
        key,
        message,
        layer,
    }
}

#[cfg(test)]
// `Jail::expect_with` closures must return `figment::Error`, which is large; not our API.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;
    use figment::Jail;

    fn no_flags() -> ServeFlags {
        ServeFlags::default()
    }

    #[test]
    fn defaults_validate_and_match_documented_values() {
        let c = ServeConfig::default();
        c.validate().unwrap();
        assert_eq!(c.model.source, "default");
        assert_eq!(c.model.weights, WeightFormat::Auto);
        assert_eq!(c.transfer.backend, TransferBackend::Shm);
        assert_eq!(c.transfer.mode, TransferMode::Pull);
        assert!(c.transfer.require_auth);
        assert_eq!(c.model.tp, 1);
        assert_eq!(c.server.host, "127.0.0.1");
        assert_eq!(c.server.port, 8000);
        assert_eq!(c.server.max_concurrent_requests, 256);
        assert_eq!(c.server.request_timeout_s, 600);
        assert_eq!(c.scheduler.max_num_seqs, 64);
        assert_eq!(c.scheduler.max_num_batched_tokens, 512);
        assert_eq!(c.scheduler.block_size, 16);
        assert_eq!(c.scheduler.kv_cache_bytes, 512 << 20);
        assert_eq!(c.instance.role, Role::Colocated);
        assert_eq!(c.logging.format, LogFormat::Human);
    }

    #[test]
    fn load_without_any_layer_gives_defaults() {
        Jail::expect_with(|_| {
            assert_eq!(
                ServeConfig::load(None, no_flags()).unwrap(),
                ServeConfig::default()
            );
            Ok(())
        });
    }

    #[test]
    fn file_then_env_then_flags_each_override_the_previous() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "pd.toml",
                r#"
                [server]
                port = 9001
                host = "0.0.0.0"
                [scheduler]
                max_num_seqs = 10
                block_size = 32
                [instance]
                role = "prefill"
                "#,
            )?;
            let path = Path::new("pd.toml");

            // The file alone beats the defaults.
            let c = ServeConfig::load(Some(path), no_flags()).unwrap();
            assert_eq!((c.server.port, c.server.host.as_str()), (9001, "0.0.0.0"));
            assert_eq!(c.scheduler.max_num_seqs, 10);
            assert_eq!(c.instance.role, Role::Prefill);

            // The environment beats the file for the same key; other file keys survive.
            jail.set_env("PDSERVE_SERVER__PORT", "9002");
            jail.set_env("PDSERVE_SCHEDULER__MAX_NUM_SEQS", "8");
            jail.set_env("PDSERVE_INSTANCE__ROLE", "decode");
            let c = ServeConfig::load(Some(path), no_flags()).unwrap();
            assert_eq!(c.server.port, 9002);
            assert_eq!(c.server.host, "0.0.0.0");
            assert_eq!(c.scheduler.max_num_seqs, 8);
            assert_eq!(c.scheduler.block_size, 32);
            assert_eq!(c.instance.role, Role::Decode);

            // Flags beat the environment; unset flags leave the lower layers alone.
            let flags = ServeFlags {
                port: Some(9003),
                role: Some(Role::Colocated),
                ..Default::default()
            };
            let c = ServeConfig::load(Some(path), &flags).unwrap();
            assert_eq!(c.server.port, 9003);
            assert_eq!(c.instance.role, Role::Colocated);
            assert_eq!(c.scheduler.max_num_seqs, 8);
            assert_eq!(c.scheduler.block_size, 32);
            assert_eq!(c.server.host, "0.0.0.0");
            Ok(())
        });
    }

    /// `scheduler.kv_cache_dtype`: file, then environment, then flag; a bad value names the key.
    #[test]
    fn kv_cache_dtype_overrides_through_file_env_and_flag() {
        Jail::expect_with(|jail| {
            jail.create_file("kv.toml", "[scheduler]\nkv_cache_dtype = \"bf16\"\n")?;
            let path = Path::new("kv.toml");
            assert_eq!(
                ServeConfig::load(None, no_flags())
                    .unwrap()
                    .scheduler
                    .kv_cache_dtype,
                KvCacheDtype::F32
            );
            let c = ServeConfig::load(Some(path), no_flags()).unwrap();
            assert_eq!(c.scheduler.kv_cache_dtype, KvCacheDtype::Bf16);
            jail.set_env("PDSERVE_SCHEDULER__KV_CACHE_DTYPE", "f16");
            let c = ServeConfig::load(Some(path), no_flags()).unwrap();
            assert_eq!(c.scheduler.kv_cache_dtype, KvCacheDtype::F16);
            let flags = ServeFlags {
                kv_cache_dtype: Some("f32".into()),
                ..Default::default()
            };
            assert_eq!(
                ServeConfig::load(Some(path), &flags)
                    .unwrap()
                    .scheduler
                    .kv_cache_dtype,
                KvCacheDtype::F32
            );
            let bad = ServeFlags {
                kv_cache_dtype: Some("fp8".into()),
                ..Default::default()
            };
            let msg = ServeConfig::load(Some(path), &bad).unwrap_err().to_string();
            assert!(
                msg.contains("scheduler.kv_cache_dtype") && msg.contains("fp8"),
                "{msg}"
            );
            Ok(())
        });
    }

    /// Every transfer-engine key: a value from the file, beaten by one from the environment,
    /// beaten by one from the flags; each layer is seen in the loaded config.
    #[test]
    fn transfer_engine_keys_override_through_file_env_and_flags() {
        type SetFlag = fn(&mut ServeFlags);
        type Get = fn(&TransferSection) -> String;
        /// Key, file value, environment value, flag setter, getter, what each layer gives.
        type Case = (
            &'static str,
            &'static str,
            &'static str,
            SetFlag,
            Get,
            [&'static str; 3],
        );
        let cases: Vec<Case> = vec![
            (
                "advertise_addr",
                "\"10.0.0.1\"",
                "10.0.0.2",
                |f| f.transfer_advertise_addr = Some("10.0.0.3:7000".into()),
                |t| format!("{:?}", t.advertise_addr),
                [
                    "Some(\"10.0.0.1\")",
                    "Some(\"10.0.0.2\")",
                    "Some(\"10.0.0.3:7000\")",
                ],
            ),
            (
                "io_threads",
                "3",
                "4",
                |f| f.transfer_io_threads = Some(5),
                |t| t.io_threads.to_string(),
                ["3", "4", "5"],
            ),
            (
                "memcpy_threads",
                "3",
                "4",
                |f| f.transfer_memcpy_threads = Some(5),
                |t| t.memcpy_threads.to_string(),
                ["3", "4", "5"],
            ),
            (
                "queue_depth",
                "30",
                "40",
                |f| f.transfer_queue_depth = Some(50),
                |t| t.queue_depth.to_string(),
                ["30", "40", "50"],
            ),
            (
                "piece_bytes",
                "65536",
                "131072",
                |f| f.transfer_piece_bytes = Some(262144),
                |t| t.piece_bytes.to_string(),
                ["65536", "131072", "262144"],
            ),
            (
                "tcp_connections",
                "2",
                "6",
                |f| f.transfer_tcp_connections = Some(8),
                |t| t.tcp_connections.to_string(),
                ["2", "6", "8"],
            ),
            (
                "registration_chunk_bytes",
                "8192",
                "16384",
                |f| f.transfer_registration_chunk_bytes = Some(32768),
                |t| format!("{:?}", t.registration_chunk_bytes),
                ["Some(8192)", "Some(16384)", "Some(32768)"],
            ),
            (
                "require_auth",
                "true",
                "false",
                |f| f.transfer_require_auth = Some(true),
                |t| t.require_auth.to_string(),
                ["true", "false", "true"],
            ),
            (
                "tcp_integrity",
                "\"mac\"",
                "encrypt",
                |f| f.transfer_tcp_integrity = Some("none".into()),
                |t| t.tcp_integrity.clone(),
                ["mac", "encrypt", "none"],
            ),
            (
                "rdma_devices",
                "\"mlx5_0\"",
                "mlx5_1",
                |f| f.rdma_devices = Some("mlx5_2,mlx5_3".into()),
                |t| t.rdma_devices.clone(),
                ["mlx5_0", "mlx5_1", "mlx5_2,mlx5_3"],
            ),
            (
                "rdma_port",
                "2",
                "3",
                |f| f.rdma_port = Some(4),
                |t| t.rdma_port.to_string(),
                ["2", "3", "4"],
            ),
            (
                "rdma_gid_index",
                "1",
                "3",
                |f| f.rdma_gid_index = Some(5),
                |t| format!("{:?}", t.rdma_gid_index),
                ["Some(1)", "Some(3)", "Some(5)"],
            ),
            (
                "rdma_mtu",
                "1024",
                "2048",
                |f| f.rdma_mtu = Some(4096),
                |t| format!("{:?}", t.rdma_mtu),
                ["Some(1024)", "Some(2048)", "Some(4096)"],
            ),
            (
                "rdma_send_queue_depth",
                "64",
                "128",
                |f| f.rdma_send_queue_depth = Some(256),
                |t| t.rdma_send_queue_depth.to_string(),
                ["64", "128", "256"],
            ),
            (
                "rdma_cq_depth",
                "2048",
                "4096",
                |f| f.rdma_cq_depth = Some(8192),
                |t| t.rdma_cq_depth.to_string(),
                ["2048", "4096", "8192"],
            ),
        ];
        for (key, file_value, env_value, set_flag, get, expect) in cases {
            Jail::expect_with(|jail| {
                jail.create_file("pd.toml", &format!("[transfer]\n{key} = {file_value}\n"))?;
                let path = Some(Path::new("pd.toml"));
                let c =
                    ServeConfig::load(path, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
                assert_eq!(get(&c.transfer), expect[0], "{key} from the file");
                jail.set_env(env_var_name(&format!("transfer.{key}")), env_value);
                let c =
                    ServeConfig::load(path, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
                assert_eq!(get(&c.transfer), expect[1], "{key} from the environment");
                let mut flags = ServeFlags::default();
                set_flag(&mut flags);
                let c = ServeConfig::load(path, &flags).unwrap_or_else(|e| panic!("{key}: {e}"));
                assert_eq!(get(&c.transfer), expect[2], "{key} from the flags");
                Ok(())
            });
        }
    }

    #[test]
    fn transfer_engine_keys_are_validated_without_a_device() {
        type Mutation = fn(&mut TransferSection);
        let cases: Vec<(&str, Mutation)> = vec![
            ("transfer.advertise_addr", |t| {
                t.advertise_addr = Some("host.example".into())
            }),
            ("transfer.io_threads", |t| t.io_threads = 0),
            ("transfer.memcpy_threads", |t| t.memcpy_threads = 65),
            ("transfer.queue_depth", |t| t.queue_depth = 0),
            ("transfer.piece_bytes", |t| t.piece_bytes = 100),
            ("transfer.tcp_connections", |t| t.tcp_connections = 65),
            ("transfer.registration_chunk_bytes", |t| {
                t.registration_chunk_bytes = Some(1)
            }),
            ("transfer.tcp_integrity", |t| {
                t.tcp_integrity = "sign".into()
            }),
            ("transfer.rdma_devices", |t| {
                t.rdma_devices = "mlx5 0".into()
            }),
            ("transfer.rdma_port", |t| t.rdma_port = 0),
            ("transfer.rdma_mtu", |t| t.rdma_mtu = Some(1500)),
            ("transfer.rdma_send_queue_depth", |t| {
                t.rdma_send_queue_depth = 0
            }),
            ("transfer.rdma_cq_depth", |t| t.rdma_cq_depth = 10),
        ];
        for (key, mutate) in cases {
            let mut c = ServeConfig::default();
            mutate(&mut c.transfer);
            let err = c.validate().expect_err(key);
            assert_eq!(err.key(), Some(key), "{err}");
        }
        let mut t = TransferSection {
            rdma_devices: " mlx5_0, ,mlx5_1 ".into(),
            ..TransferSection::default()
        };
        assert_eq!(t.rdma_device_list(), vec!["mlx5_0", "mlx5_1"]);
        t.advertise_addr = Some("10.1.2.3:9000".into());
        assert!(t.invalid().is_none());
    }

    #[test]
    fn every_flag_lands_on_its_key() {
        Jail::expect_with(|_| {
            let flags = ServeFlags {
                model: Some("synthetic:tiny".into()),
                served_model_name: vec!["served".into(), "alias".into()],
                tp: Some(2),
                weights: Some("f32".into()),
                host: Some("0.0.0.0".into()),
                port: Some(1234),
                api_key: Some("sk-1".into()),
                role: Some(Role::Decode),
                name: Some("d-1".into()),
                max_num_seqs: Some(4),
                max_num_batched_tokens: Some(64),
                block_size: Some(8),
                num_blocks: Some(100),
                log_filter: Some("debug".into()),
                log_format: Some(LogFormat::Json),
                transfer: Some("tcp".into()),
                transfer_listen: Some("127.0.0.1:7000".into()),
                credentials_dir: Some("/tmp/creds".into()),
                transfer_mode: Some("push".into()),
                min_remote_prompt_tokens: Some(64),
                control_listen: Some("127.0.0.1:7100".into()),
                control_proxy: Some("127.0.0.1:7000".into()),
                // The transfer engine's keys: `transfer_engine_keys_override_through_...`;
                // `device` and `dtype`: the CUDA tests.
                ..Default::default()
            };
            let c = ServeConfig::load(None, &flags).unwrap();
            assert_eq!(c.transfer.mode, TransferMode::Push);
            assert_eq!(c.transfer.min_remote_prompt_tokens, 64);
            assert_eq!(c.control.listen, "127.0.0.1:7100");
            assert_eq!(c.control.proxy.as_deref(), Some("127.0.0.1:7000"));
            assert_eq!(c.transfer.backend, TransferBackend::Tcp);
            assert_eq!(c.transfer.listen, "127.0.0.1:7000");
            assert_eq!(c.transfer.credentials_dir.as_deref(), Some("/tmp/creds"));
            assert_eq!(c.model.source, "synthetic:tiny");
            assert_eq!(c.model.name, ["served", "alias"]);
            assert_eq!(c.model.tp, 2);
            assert_eq!(c.model.weights, WeightFormat::F32);
            // The device flags, in a load of their own (f32 is a CPU weight format).
            let cuda = ServeFlags {
                device: Some("cuda:2".into()),
                dtype: Some("bf16".into()),
                ..ServeFlags::default()
            };
            let d = ServeConfig::load(None, &cuda).unwrap();
            assert_eq!(
                (d.model.device.as_str(), d.model.dtype.as_str()),
                ("cuda:2", "bf16")
            );
            assert_eq!(c.server.host, "0.0.0.0");
            assert_eq!(c.server.port, 1234);
            assert_eq!(c.server.api_key.as_deref(), Some("sk-1"));
            assert_eq!(c.instance.role, Role::Decode);
            assert_eq!(c.instance.name, "d-1");
            assert_eq!(c.scheduler.max_num_seqs, 4);
            assert_eq!(c.scheduler.max_num_batched_tokens, 64);
            assert_eq!(c.scheduler.block_size, 8);
            assert_eq!(c.scheduler.num_blocks, Some(100));
            assert_eq!(c.logging.filter, "debug");
            assert_eq!(c.logging.format, LogFormat::Json);
            Ok(())
        });
    }

    #[test]
    fn unknown_key_in_toml_names_key_and_file() {
        Jail::expect_with(|jail| {
            jail.create_file("pd.toml", "[scheduler]\nmax_num_seq = 4\n")?;
            let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
            assert_eq!(err.kind(), "config_unknown_key");
            let msg = err.to_string();
            assert!(msg.contains("scheduler.max_num_seq"), "{msg}");
            assert!(msg.contains("pd.toml"), "{msg}");
            match err {
                ConfigError::UnknownKey { key, layer, .. } => {
                    assert_eq!(key, "scheduler.max_num_seq");
                    assert!(matches!(layer, Some(ConfigLayer::File(_))), "{layer:?}");
                }
                other => panic!("{other:?}"),
            }
            Ok(())
        });
    }

    #[test]
    fn unknown_section_in_toml_rejected() {
        Jail::expect_with(|jail| {
            jail.create_file("pd.toml", "[sheduler]\nmax_num_seqs = 4\n")?;
            let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("sheduler"), "{msg}");
            assert_eq!(err.kind(), "config_unknown_key");
            Ok(())
        });
    }

    #[test]
    fn unknown_env_key_rejected_with_variable_name() {
        Jail::expect_with(|jail| {
            jail.set_env("PDSERVE_SERVER__PROTT", "9000");
            let err = ServeConfig::load(None, no_flags()).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("server.prott"), "{msg}");
            assert!(msg.contains("PDSERVE_SERVER__PROTT"), "{msg}");
            assert_eq!(err.key(), Some("server.prott"));
            assert!(
                matches!(
                    err,
                    ConfigError::UnknownKey {
                        layer: Some(ConfigLayer::Env(_)),
                        ..
                    }
                ),
                "{err:?}"
            );
            Ok(())
        });
    }

    #[test]
    fn unrelated_pdserve_variables_are_ignored() {
        Jail::expect_with(|jail| {
            jail.set_env("PDSERVE_HOME", "/tmp/pdserve-home");
            jail.set_env("PDSERVE_LOG", "debug");
            jail.set_env("PDSERVE_PYTHON", "/usr/bin/python3");
            jail.set_env("PDSERVE_TRANSFER_PEER_SEED", "7");
            assert_eq!(
                ServeConfig::load(None, no_flags()).unwrap(),
                ServeConfig::default()
            );
            Ok(())
        });
    }

    #[test]
    fn bad_value_types_rejected_from_every_layer() {
        Jail::expect_with(|jail| {
            // Flags layer.
            let err =
                ServeConfig::load(None, serde_json::json!({"model": {"tp": "two"}})).unwrap_err();
            assert_eq!(err.kind(), "config_invalid_value");
            let msg = err.to_string();
            assert!(
                msg.contains("model.tp") && msg.contains("command-line flags"),
                "{msg}"
            );

            // File layer.
            jail.create_file("pd.toml", "[server]\nport = \"eighty\"\n")?;
            let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("server.port") && msg.contains("pd.toml"),
                "{msg}"
            );

            // Environment layer: a bad enum variant and an out-of-range integer.
            jail.set_env("PDSERVE_INSTANCE__ROLE", "router");
            let err = ServeConfig::load(None, no_flags()).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("instance.role") && msg.contains("PDSERVE_INSTANCE__ROLE"),
                "{msg}"
            );
            jail.set_env("PDSERVE_INSTANCE__ROLE", "decode");
            jail.set_env("PDSERVE_SERVER__PORT", "70000");
            let err = ServeConfig::load(None, no_flags()).unwrap_err();
            assert!(err.to_string().contains("server.port"), "{err}");
            Ok(())
        });
    }

    /// `transfer.backend`, `transfer.mode` and `model.weights` are enums: a value outside
    /// their names is refused when the layer is parsed, naming the key, the layer and the
    /// accepted values.
    #[test]
    fn bad_enum_values_are_refused_at_parse_from_file_env_and_flags() {
        let cases = [
            ("transfer", "backend", "ucx", "local, shm, tcp, quic, rdma"),
            ("transfer", "mode", "both", "pull, push"),
            ("model", "weights", "q4", "auto, native, q8_0, f32"),
        ];
        for (section, field, bad, accepted) in cases {
            let key = format!("{section}.{field}");
            let expect = |err: ConfigError, layer: &str| {
                assert_eq!(err.kind(), "config_invalid_value", "{key}: {err}");
                assert_eq!(err.key(), Some(key.as_str()), "{err}");
                let msg = err.to_string();
                assert!(
                    msg.contains(&format!("{key} must be one of {accepted}, got `{bad}`")),
                    "{msg}"
                );
                assert!(msg.contains(layer), "{layer}: {msg}");
            };
            Jail::expect_with(|jail| {
                jail.create_file("pd.toml", &format!("[{section}]\n{field} = \"{bad}\"\n"))?;
                let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
                expect(err, "pd.toml");

                jail.set_env(env_var_name(&key), bad);
                let err = ServeConfig::load(None, no_flags()).unwrap_err();
                expect(err, &env_var_name(&key));
                jail.clear_env();

                let flags = serde_json::json!({ section: { field: bad } });
                let err = ServeConfig::load(None, flags).unwrap_err();
                expect(err, "command-line flags");
                Ok(())
            });
        }
    }

    #[test]
    fn enum_names_round_trip_and_every_spelling_in_use_still_parses() {
        fn round_trip<T>(all: &[T], names: &[&str])
        where
            T: Copy + PartialEq + fmt::Debug + fmt::Display + std::str::FromStr + Serialize,
            T: serde::de::DeserializeOwned,
            T::Err: fmt::Debug,
        {
            assert_eq!(all.len(), names.len());
            for (v, name) in all.iter().zip(names) {
                assert_eq!(v.to_string(), *name);
                assert_eq!(name.parse::<T>().unwrap(), *v);
                let json = serde_json::to_string(v).unwrap();
                assert_eq!(json, format!("\"{name}\""));
                assert_eq!(serde_json::from_str::<T>(&json).unwrap(), *v);
            }
        }
        round_trip(
            &TransferBackend::ALL,
            &["local", "shm", "tcp", "quic", "rdma"],
        );
        round_trip(&TransferMode::ALL, &["pull", "push"]);
        round_trip(&WeightFormat::ALL, &["auto", "native", "q8_0", "f32"]);
        // The older alias of `q8_0` (`pdserve run --weights q8`).
        assert_eq!("q8".parse::<WeightFormat>().unwrap(), WeightFormat::Q8_0);
        Jail::expect_with(|jail| {
            jail.create_file(
                "pd.toml",
                "[transfer]\nbackend = \"tcp\"\nmode = \"push\"\n[model]\nweights = \"native\"\n",
            )?;
            let c = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap();
            assert_eq!(c.transfer.backend, TransferBackend::Tcp);
            assert_eq!(c.transfer.mode, TransferMode::Push);
            assert_eq!(c.model.weights, WeightFormat::Native);
            jail.set_env("PDSERVE_TRANSFER__BACKEND", "quic");
            jail.set_env("PDSERVE_MODEL__WEIGHTS", "f32");
            let c = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap();
            assert_eq!(c.transfer.backend, TransferBackend::Quic);
            assert_eq!(c.model.weights, WeightFormat::F32);
            let flags = ServeFlags {
                transfer: Some("rdma".into()),
                transfer_mode: Some("pull".into()),
                weights: Some("q8_0".into()),
                ..ServeFlags::default()
            };
            let c = ServeConfig::load(Some(Path::new("pd.toml")), &flags).unwrap();
            assert_eq!(c.transfer.backend, TransferBackend::Rdma);
            assert_eq!(c.transfer.mode, TransferMode::Pull);
            assert_eq!(c.model.weights, WeightFormat::Q8_0);
            Ok(())
        });
    }

    #[test]
    fn missing_config_file_is_an_error() {
        Jail::expect_with(|_| {
            let err = ServeConfig::load(Some(Path::new("nope.toml")), no_flags()).unwrap_err();
            assert_eq!(err.kind(), "config_file");
            assert!(err.to_string().contains("nope.toml"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn toml_syntax_error_is_reported() {
        Jail::expect_with(|jail| {
            jail.create_file("pd.toml", "[server\nport = 1\n")?;
            let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
            assert!(err.to_string().contains("pd.toml"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn validation_errors_name_the_key_and_layer() {
        Jail::expect_with(|jail| {
            jail.set_env("PDSERVE_SCHEDULER__BLOCK_SIZE", "24");
            let err = ServeConfig::load(None, no_flags()).unwrap_err();
            assert_eq!(err.kind(), "config_invalid");
            let msg = err.to_string();
            assert!(
                msg.contains("scheduler.block_size must be a power of two between 1 and 256"),
                "{msg}"
            );
            assert!(msg.contains("PDSERVE_SCHEDULER__BLOCK_SIZE"), "{msg}");
            Ok(())
        });
    }

    #[test]
    fn validate_rejects_out_of_range_values() {
        type Mutation = fn(&mut ServeConfig);
        let cases: Vec<(&str, Mutation)> = vec![
            ("server.port must be > 0", |c| c.server.port = 0),
            ("model.tp must be ≥ 1", |c| c.model.tp = 0),
            ("model.device", |c| c.model.device = "gpu".into()),
            ("model.device", |c| c.model.device = "cuda:".into()),
            ("model.dtype", |c| c.model.dtype = "f8".into()),
            ("a CPU format", |c| {
                c.model.device = "cuda".into();
                c.model.weights = WeightFormat::Q8_0;
            }),
            ("model.source", |c| c.model.source = "synthetic:".into()),
            ("scheduler.block_size", |c| c.scheduler.block_size = 512),
            ("scheduler.block_size", |c| c.scheduler.block_size = 0),
            ("scheduler.watermark", |c| c.scheduler.watermark = 0.5),
            ("scheduler.watermark", |c| c.scheduler.watermark = -0.1),
            ("scheduler.watermark", |c| c.scheduler.watermark = f64::NAN),
            ("scheduler.max_num_seqs", |c| c.scheduler.max_num_seqs = 0),
            ("scheduler.max_num_batched_tokens", |c| {
                c.scheduler.max_num_batched_tokens = 32
            }),
            ("scheduler.num_blocks", |c| c.scheduler.num_blocks = Some(0)),
            ("scheduler.kv_cache_bytes", |c| {
                c.scheduler.kv_cache_bytes = 0
            }),
            ("server.max_concurrent_requests", |c| {
                c.server.max_concurrent_requests = 0
            }),
            ("server.max_connections", |c| c.server.max_connections = 0),
            ("server.max_connections", |c| {
                c.server.max_connections = MAX_CONNECTIONS + 1
            }),
            ("server.header_read_timeout_s", |c| {
                c.server.header_read_timeout_s = 0
            }),
            ("instance.name", |c| c.instance.name = "a b".into()),
            ("logging.filter", |c| c.logging.filter = "info,[[[".into()),
            ("control.listen", |c| c.control.listen = "anywhere".into()),
            ("control.proxy", |c| {
                c.control.proxy = Some("proxy:7000".into())
            }),
            ("control.proxy", |c| {
                c.control.proxy = Some("127.0.0.1:0".into())
            }),
            ("control.heartbeat_ms", |c| c.control.heartbeat_ms = 0),
            ("control.heartbeat_ms", |c| c.control.heartbeat_ms = 600_000),
            ("server.tls_key is not", |c| {
                c.server.tls_cert = Some("cert.pem".into())
            }),
            ("server.tls_cert is not", |c| {
                c.server.tls_key = Some("key.pem".into())
            }),
            ("server.tls_ca must not be empty", |c| {
                c.server.tls_ca = Some(" ".into())
            }),
        ];
        for (needle, mutate) in cases {
            let mut c = ServeConfig::default();
            mutate(&mut c);
            let err = c.validate().expect_err(needle);
            assert!(err.to_string().contains(needle), "{needle}: {err}");
        }
        // Edges that are valid.
        let mut c = ServeConfig::default();
        c.scheduler.block_size = 256;
        c.scheduler.watermark = 0.0;
        c.scheduler.kv_cache_bytes = 0;
        c.scheduler.num_blocks = Some(1);
        c.validate().unwrap();
        c.scheduler.block_size = 1;
        c.validate().unwrap();
        // Port 0 with a proxy to register with (the bound address reaches it that way).
        c.server.port = 0;
        c.control.proxy = Some("127.0.0.1:9".into());
        c.validate().unwrap();
    }

    #[test]
    fn served_model_names_layer_as_one_string_or_a_list() {
        Jail::expect_with(|jail| {
            jail.create_file("one.toml", "[model]\nname = \"gpt-x\"\n")?;
            let c = ServeConfig::load(Some(Path::new("one.toml")), no_flags()).unwrap();
            assert_eq!(c.model.name, ["gpt-x"]);
            jail.create_file("list.toml", "[model]\nname = [\"a\", \"b\"]\n")?;
            let path = Some(Path::new("list.toml"));
            let c = ServeConfig::load(path, no_flags()).unwrap();
            assert_eq!(c.model.name, ["a", "b"]);
            jail.set_env(env_var_name("model.name"), "[c, d, e]");
            let c = ServeConfig::load(path, no_flags()).unwrap();
            assert_eq!(c.model.name, ["c", "d", "e"]);
            let flags = ServeFlags {
                served_model_name: vec!["f".into()],
                ..ServeFlags::default()
            };
            let c = ServeConfig::load(path, &flags).unwrap();
            assert_eq!(c.model.name, ["f"]);
            jail.set_env(env_var_name("model.name"), "[c, c]");
            let err = ServeConfig::load(path, no_flags()).unwrap_err();
            assert_eq!(err.key(), Some("model.name"), "{err}");
            jail.set_env(env_var_name("model.name"), "\" \"");
            let err = ServeConfig::load(path, no_flags()).unwrap_err();
            assert_eq!(err.key(), Some("model.name"), "{err}");
            Ok(())
        });
        assert!(ServeConfig::default().model.name.is_empty());
    }

    #[test]
    fn env_var_name_follows_the_rule() {
        assert_eq!(env_var_name("server.port"), "PDSERVE_SERVER__PORT");
        assert_eq!(
            env_var_name("scheduler.max_num_seqs"),
            "PDSERVE_SCHEDULER__MAX_NUM_SEQS"
        );
    }

    #[test]
    fn every_config_key_is_settable_from_env() {
        // Walk the serialized default tree and set each key through its variable: catches a
        // field whose name would not survive the env mapping.
        let tree = serde_json::to_value(ServeConfig::default()).unwrap();
        let mut keys = Vec::new();
        for (section, fields) in tree.as_object().unwrap() {
            for field in fields.as_object().unwrap().keys() {
                keys.push(format!("{section}.{field}"));
            }
        }
        assert!(keys.len() >= 20, "{keys:?}");
        Jail::expect_with(|jail| {
            for key in &keys {
                jail.clear_env();
                let value = match key.as_str() {
                    "model.source" => "synthetic:x",
                    "model.name"
                    | "server.api_key"
                    | "server.host"
                    | "instance.name"
                    | "transfer.credentials_dir" => "abc",
                    "transfer.backend" => "tcp",
                    "transfer.mode" => "push",
                    "transfer.min_remote_prompt_tokens" => "64",
                    "transfer.advertise_addr" => "10.0.0.7",
                    "transfer.io_threads"
                    | "transfer.memcpy_threads"
                    | "transfer.tcp_connections" => "8",
                    "transfer.piece_bytes" | "transfer.registration_chunk_bytes" => "8192",
                    // The default is `true`: the variable must change it.
                    "transfer.require_auth" | "scheduler.prefix_cache" => "false",
                    "transfer.tcp_integrity" => "mac",
                    "transfer.rdma_devices" => "mlx5_0,mlx5_1",
                    "transfer.rdma_port" => "2",
                    "transfer.rdma_send_queue_depth" => "256",
                    "transfer.listen" | "control.listen" | "control.proxy" => "127.0.0.1:9999",
                    "model.weights" => "q8_0",
                    "scheduler.kv_cache_dtype" => "f16",
                    "model.device" => "cuda:1",
                    "model.dtype" => "bf16",
                    "instance.role" => "prefill",
                    "logging.filter" => "warn",
                    "logging.format" => "json",
                    "faults.actor_panic_target" => "KvSender",
                    "scheduler.watermark" => "0.2",
                    k if k.starts_with("faults.")
                        && !k.ends_with("_ms")
                        && !k.ends_with("_max")
                        && k != "faults.seed" =>
                    {
                        "0.5"
                    }
                    "scheduler.block_size" | "scheduler.max_num_seqs" => "32",
                    "server.port" | "scheduler.num_blocks" | "scheduler.max_model_len" => "4096",
                    _ => "2048",
                };
                jail.set_env(env_var_name(key), value);
                // HTTPS takes a certificate and its key together.
                let partner = match key.as_str() {
                    "server.tls_cert" => Some("server.tls_key"),
                    "server.tls_key" => Some("server.tls_cert"),
                    _ => None,
                };
                if let Some(partner) = partner {
                    jail.set_env(env_var_name(partner), "other.pem");
                }
                let c =
                    ServeConfig::load(None, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
                let got = serde_json::to_value(&c).unwrap();
                let (section, field) = key.split_once('.').unwrap();
                let before = &tree[section][field];
                assert_ne!(&got[section][field], before, "{key} not applied from env");
            }
            Ok(())
        });
    }

    #[test]
    fn numeric_looking_strings_from_env_stay_strings() {
        Jail::expect_with(|jail| {
            jail.set_env("PDSERVE_SERVER__API_KEY", "12345");
            jail.set_env("PDSERVE_INSTANCE__NAME", "7");
            let c = ServeConfig::load(None, no_flags()).unwrap();
            assert_eq!(c.server.api_key.as_deref(), Some("12345"));
            assert_eq!(c.instance.name, "7");
            Ok(())
        });
    }

    #[test]
    fn the_proxy_config_layers_file_env_and_flags_and_ignores_instance_sections() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "proxy.toml",
                "[proxy]\nport = 9100\ndecode = [\"http://10.0.0.3:8200\"]\ntimeout_s = 30\n",
            )?;
            jail.set_env("PDSERVE_PROXY__TIMEOUT_S", "45");
            // An instance's variable in the same environment is not the proxy's business.
            jail.set_env("PDSERVE_SERVER__PORT", "9002");
            #[derive(Serialize)]
            struct Flags {
                proxy: Partial,
            }
            #[derive(Serialize)]
            struct Partial {
                max_prefill_queue: usize,
            }
            let c = ProxyConfig::load(
                Some(Path::new("proxy.toml")),
                Flags {
                    proxy: Partial {
                        max_prefill_queue: 3,
                    },
                },
            )
            .unwrap();
            assert_eq!(c.proxy.port, 9100, "file");
            assert_eq!(c.proxy.decode, vec!["http://10.0.0.3:8200".to_string()]);
            assert_eq!(c.proxy.timeout_s, 45, "env over file");
            assert_eq!(c.proxy.max_prefill_queue, Some(3), "flags");
            assert_eq!(c.proxy.node, "proxy", "default");
            // HTTPS: a certificate from the environment without its key is refused.
            let no_flags = serde_json::json!({});
            jail.set_env("PDSERVE_PROXY__TLS_CERT", "proxy.pem");
            let e = ProxyConfig::load(None, &no_flags).unwrap_err().to_string();
            assert!(e.contains("proxy.tls_key is not"), "{e}");
            jail.set_env("PDSERVE_PROXY__TLS_KEY", "proxy.key");
            let c = ProxyConfig::load(None, &no_flags).unwrap();
            assert_eq!(c.proxy.tls_key.as_deref(), Some("proxy.key"));
            jail.set_env("PDSERVE_PROXY__TIMEOUT", "45");
            let e = ProxyConfig::load(None, ProxyConfig::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains("PDSERVE_PROXY__TIMEOUT"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn the_proxy_router_settings_parse_and_bad_ones_are_named() {
        // In a jail: the loader reads PDSERVE_PROXY__* variables other tests set.
        figment::Jail::expect_with(|_jail| {
            let load = |flags: serde_json::Value| ProxyConfig::load(None, flags);
            let c = load(serde_json::json!({})).unwrap();
            assert_eq!(c.proxy.router, RouterKind::Kv, "kv is the default");
            let c = load(
                serde_json::json!({"proxy": {"router": "round-robin", "prefill_load_scale": 2.5}}),
            )
            .unwrap();
            assert_eq!(
                (c.proxy.router, c.proxy.prefill_load_scale),
                (RouterKind::RoundRobin, 2.5)
            );
            assert_eq!(
                "least-loaded".parse::<RouterKind>().unwrap().as_str(),
                "least-loaded"
            );
            assert!("random"
                .parse::<RouterKind>()
                .unwrap_err()
                .contains("kv, least-loaded"));
            let e = load(serde_json::json!({"proxy": {"router": "random"}}))
                .unwrap_err()
                .to_string();
            assert!(e.contains("random"), "{e}");
            for (key, bad) in [
                ("prefill_load_scale", serde_json::json!(-1.0)),
                ("kv_index_max_blocks", serde_json::json!(0)),
                ("max_concurrent_requests", serde_json::json!(0)),
                ("max_connections", serde_json::json!(0)),
                ("header_read_timeout_s", serde_json::json!(0)),
            ] {
                let e = load(serde_json::json!({"proxy": {key: bad}}))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(&format!("proxy.{key}")), "{key}: {e}");
            }
            Ok(())
        });
    }
}
