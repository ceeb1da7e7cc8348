//! Checking a loaded serving config: ranges and consistency ([`ServeConfig::validate`]),
//! and the TLS settings both the server and the proxy have.

use super::serve::*;
use super::values::*;
use crate::error::ConfigError;

/// `SECTION.tls_cert` and `SECTION.tls_key` come together, and no TLS path is empty. (Whether
/// the files hold a certificate and its key is checked when the server starts.)
pub(super) fn check_tls(
    section: &str,
    [cert, key, ca]: [&Option<String>; 3],
) -> Result<(), ConfigError> {
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

impl ServeConfig {
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
        if let Some((key, message)) = self.multimodal.invalid() {
            return invalid(key, message);
        }
        if !self.instance.role.is_instance() {
            return invalid(
                "instance.role",
                format!(
                    "instance.role must be colocated, prefill, decode or encode, got `{}`",
                    self.instance.role
                ),
            );
        }
        let tiers = &self.kv_tiers;
        if tiers.enabled
            && tiers.host_capacity_bytes == 0
            && tiers.disk_dir.is_none()
            && tiers.shared_dir.is_none()
            && tiers.shared_url.is_none()
        {
            return invalid(
                "kv_tiers.enabled",
                "kv_tiers.enabled needs kv_tiers.host_capacity_bytes > 0, kv_tiers.disk_dir, \
                 kv_tiers.shared_dir or kv_tiers.shared_url",
            );
        }
        if tiers.enabled && tiers.disk_dir.is_some() && tiers.disk_capacity_bytes == 0 {
            return invalid(
                "kv_tiers.disk_capacity_bytes",
                "kv_tiers.disk_capacity_bytes must be > 0 with kv_tiers.disk_dir",
            );
        }
        if tiers.disk_dir.as_deref() == Some("") {
            return invalid("kv_tiers.disk_dir", "kv_tiers.disk_dir must not be empty");
        }
        let shared = tiers.shared_dir.is_some() || tiers.shared_url.is_some();
        if tiers.enabled && shared && tiers.shared_capacity_bytes == 0 {
            return invalid(
                "kv_tiers.shared_capacity_bytes",
                "kv_tiers.shared_capacity_bytes must be > 0 with a shared store",
            );
        }
        if tiers.shared_dir.is_some() && tiers.shared_url.is_some() {
            return invalid(
                "kv_tiers.shared_url",
                "kv_tiers.shared_url and kv_tiers.shared_dir are two shared stores: set one",
            );
        }
        if let Some(url) = &tiers.shared_url {
            if !(url.starts_with("redis://") || url.starts_with("redis+unix://")) {
                return invalid(
                    "kv_tiers.shared_url",
                    format!(
                        "kv_tiers.shared_url must be redis://HOST:PORT/DB or \
                         redis+unix:///PATH, got `{url}`"
                    ),
                );
            }
        }
        if tiers.shared_dir.as_deref() == Some("") {
            return invalid(
                "kv_tiers.shared_dir",
                "kv_tiers.shared_dir must not be empty",
            );
        }
        if tiers.shared_dir.is_some() && tiers.shared_dir == tiers.disk_dir {
            return invalid(
                "kv_tiers.shared_dir",
                "kv_tiers.shared_dir must differ from kv_tiers.disk_dir (the disk tier's \
                 directory is this instance's alone)",
            );
        }
        if tiers.load_timeout_ms == 0 {
            return invalid(
                "kv_tiers.load_timeout_ms",
                "kv_tiers.load_timeout_ms must be > 0",
            );
        }
        if tiers.selective_min_hits == 0 {
            return invalid(
                "kv_tiers.selective_min_hits",
                "kv_tiers.selective_min_hits must be >= 1",
            );
        }
        if tiers.enabled && !self.scheduler.prefix_cache {
            return invalid(
                "kv_tiers.enabled",
                "kv_tiers needs scheduler.prefix_cache (the tiers hold the prefix cache's evicted blocks)",
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
        if let Some((key, message)) = ctl.discovery.invalid("control.discovery") {
            return invalid(&key, message);
        }
        if ctl.discovery.is_etcd() && self.transfer.credentials_dir.is_none() {
            return invalid(
                "control.discovery.kind",
                "control.discovery.kind = \"etcd\" needs transfer.credentials_dir: instances register with the proxies over the control plane (pdserve cluster init)",
            );
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
        if !(1..=super::serve::MAX_MAILBOX_CAPACITY).contains(&c.mailbox_capacity) {
            return invalid(
                "scheduler.mailbox_capacity",
                format!(
                    "scheduler.mailbox_capacity must be in 1..={}",
                    super::serve::MAX_MAILBOX_CAPACITY
                ),
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
