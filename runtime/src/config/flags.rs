//! The command-line layer: [`ServeFlags`], serialized into the config's nested shape.

use serde::Serialize;

use super::serve::LogFormat;
use crate::role::Role;

/// The command-line flags that override config keys: every field is optional and only the
/// ones set are applied (the top layer of
/// [`ServeConfig::load`](super::ServeConfig::load)).
///
/// It serializes into the config's nested shape (`tp` becomes `model.tp`, `port` becomes
/// `server.port`, ...), so it can be passed to
/// [`ServeConfig::load`](super::ServeConfig::load) as is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeFlags {
    /// `model.source`.
    pub model: Option<String>,
    /// `model.mmproj`.
    pub mmproj: Option<String>,
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
    /// `[control.discovery]`, whole (a deployment file's `discovery = "etcd"`).
    pub discovery: Option<super::DiscoveryConfig>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    discovery: Option<&'a super::DiscoveryConfig>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    mmproj: Option<&'a str>,
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
                mmproj: self.mmproj.as_deref(),
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
                discovery: self.discovery.as_ref(),
            },
        }
        .serialize(serializer)
    }
}
