//! The proxy's configuration ([`ProxyConfig`], the `[proxy]` section), loaded in the same
//! layers as the serving config.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::layers::{extract_validated, layered};
use super::lenient;
use super::serve::{LoggingConfig, MAX_CONNECTIONS};
use super::validate::check_tls;
use super::values::UnknownValue;
use crate::error::ConfigError;

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
    /// Static encode instances (E/P/D): requests with images go to one of them first.
    pub encode: Vec<String>,
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
    /// Seconds a stopping proxy (SIGTERM, Ctrl-C) waits for the requests in flight to finish,
    /// answering `/health` with 503 `draining` meanwhile, before it closes what is left
    /// (0..=3600).
    pub drain_timeout_s: u64,
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
    /// The IP this proxy publishes in its etcd record (its control address and URL, with the
    /// ports it bound), for a proxy bound to all interfaces (`0.0.0.0`), whose bound address
    /// nobody can reach: in a Kubernetes pod, the pod IP. Unset: the bound addresses.
    #[serde(deserialize_with = "lenient::opt_string")]
    pub advertise_addr: Option<String>,
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
    /// What the KV router credits a prefix block found in an instance's KV tier, against 1
    /// for one in its block pool (`[proxy.kv_tier_credit]`).
    pub kv_tier_credit: TierCredit,
    /// Where the instances are: `static` (the lists above, and instances that register with
    /// this proxy), or etcd (`[proxy.discovery] kind = "etcd"`: this proxy keeps its own record
    /// there under a lease, so instances find and register with it, and routes only to
    /// instances whose etcd record is alive).
    pub discovery: super::DiscoveryConfig,
}

/// The KV router's credit for a prompt block an instance holds below its block pool
/// (`[proxy.kv_tier_credit]`): a block in the pool saves computing it (credit 1); one in a
/// tier saves the compute less its load-back (copied from host memory, read from a file,
/// fetched from the shared store), so it counts less. Each is in `0..=1`.
///
/// The defaults reflect the restore paths' costs against recomputing a block: a host copy is
/// a memory copy (0.8), a disk read a file read and checksum (0.5), the shared store a
/// network or shared-filesystem read (0.4); every instance that reads a shared store reports
/// the blocks it lists, so each of them is credited.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierCredit {
    /// A block in the host spill region.
    pub host: f64,
    /// A block in the local disk tier.
    pub disk: f64,
    /// A block in the shared store (directory or Redis).
    pub shared: f64,
}

impl Default for TierCredit {
    fn default() -> Self {
        Self {
            host: 0.8,
            disk: 0.5,
            shared: 0.4,
        }
    }
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
    /// The accepted spellings, in declaration order.
    pub const NAMES: &'static [&'static str] = &["kv", "least-loaded", "round-robin"];

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
    type Err = UnknownValue;

    /// # Errors
    /// [`UnknownValue`] naming `proxy.router`, the value and [`RouterKind::NAMES`].
    fn from_str(s: &str) -> Result<Self, UnknownValue> {
        match s {
            "kv" => Ok(Self::Kv),
            "least-loaded" => Ok(Self::LeastLoaded),
            "round-robin" => Ok(Self::RoundRobin),
            other => Err(UnknownValue {
                key: "proxy.router",
                value: other.to_string(),
                expected: Self::NAMES,
            }),
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
            encode: Vec::new(),
            timeout_s: 600,
            max_prefill_queue: None,
            max_concurrent_requests: 1024,
            max_connections: 4096,
            header_read_timeout_s: 30,
            drain_timeout_s: 30,
            api_key: None,
            credentials_dir: None,
            node: "proxy".into(),
            control_listen: "127.0.0.1:0".into(),
            advertise_addr: None,
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
            kv_tier_credit: TierCredit::default(),
            discovery: super::DiscoveryConfig::default(),
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
    /// As [`ServeConfig::load`](super::ServeConfig::load).
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
        for (key, v) in [
            ("proxy.kv_tier_credit.host", p.kv_tier_credit.host),
            ("proxy.kv_tier_credit.disk", p.kv_tier_credit.disk),
            ("proxy.kv_tier_credit.shared", p.kv_tier_credit.shared),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return invalid(key, format!("{key} must be a number in 0..=1, got {v}"));
            }
        }
        if let Some((key, message)) = p.discovery.invalid("proxy.discovery") {
            return invalid(&key, message);
        }
        if p.discovery.is_etcd() && p.credentials_dir.is_none() {
            return invalid(
                "proxy.discovery.kind",
                "proxy.discovery.kind = \"etcd\" needs proxy.credentials_dir: instances register with the proxy over the control plane (pdserve cluster init)".into(),
            );
        }
        if p.drain_timeout_s > 3600 {
            return invalid(
                "proxy.drain_timeout_s",
                format!(
                    "proxy.drain_timeout_s must be 0..=3600, got {}",
                    p.drain_timeout_s
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
        let Ok(control_listen) = p.control_listen.parse::<std::net::SocketAddr>() else {
            return invalid(
                "proxy.control_listen",
                format!(
                    "proxy.control_listen must be an IP:port, got `{}`",
                    p.control_listen
                ),
            );
        };
        if let Some(a) = &p.advertise_addr {
            if !a
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| !ip.is_unspecified())
            {
                return invalid(
                    "proxy.advertise_addr",
                    format!("proxy.advertise_addr must be an IP address others reach this proxy at (not 0.0.0.0 or ::), got `{a}`"),
                );
            }
        }
        // Instances connect to the control address the proxy's etcd record names: `0.0.0.0`
        // there would send each of them to itself.
        if p.discovery.is_etcd()
            && control_listen.ip().is_unspecified()
            && p.advertise_addr.is_none()
        {
            return invalid(
                "proxy.control_listen",
                format!(
                    "proxy.control_listen {control_listen} binds every interface: with proxy.discovery.kind = \"etcd\" set proxy.advertise_addr to the IP instances reach this proxy at (in a pod, its pod IP), which its etcd record publishes"
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
