//! What the Proxy is started from and answers: [`ProxyMsg`], [`ProxyArgs`],
//! [`ProxyControlArgs`], [`ProxyStart`], and what its supervisor shows of it.

use pdserve_transport::control::tls::MemberCredentials;
use ractor::RpcReplyPort;
use std::net::SocketAddr;
use std::time::Duration;

/// Messages of the Proxy.
pub enum ProxyMsg {
    /// The bound address.
    LocalAddr(RpcReplyPort<SocketAddr>),
    /// Where the control plane listens (`None`: started without one).
    ControlAddr(RpcReplyPort<Option<SocketAddr>>),
    /// Start draining (`/health` answers 503 from now on; requests still arriving are served)
    /// and answer how many requests are in flight.
    Drain(RpcReplyPort<usize>),
}

/// Where the proxy listens and what it routes to.
#[derive(Clone, Debug)]
pub struct ProxyArgs {
    /// Address to bind.
    pub bind: SocketAddr,
    /// Prefill instance URLs (`http://host:port`).
    pub prefill: Vec<String>,
    /// Decode instance URLs.
    pub decode: Vec<String>,
    /// Static encode instances (E/P/D): requests with images go to one of them first.
    pub encode: Vec<String>,
    /// Bound on each upstream call.
    pub timeout: Duration,
    /// Conditional disaggregation: when the least-loaded prefill instance has more requests
    /// queued or running than this, the decode instance prefills the request itself.
    pub max_prefill_queue: Option<usize>,
    /// Requests forwarded at once; one more is answered 503 (`proxy.max_concurrent_requests`).
    pub max_concurrent_requests: usize,
    /// Bounds on the front door's connections (`proxy.max_connections`,
    /// `proxy.header_read_timeout_s`).
    pub conn_limits: crate::http::ConnLimits,
    /// Bearer token the front door requires (`/v1/*`; `/health` and `/metrics` stay open).
    pub api_key: Option<String>,
    /// Bound on one call between the proxy's actors (`proxy.actor_call_timeout_ms`).
    pub call_timeout: Duration,
    /// HTTPS of the front door, and the trust its calls to `https://` instances use.
    pub tls: crate::http::HttpTls,
    /// Times one request may move to another decode instance when the one serving it dies or
    /// its stream breaks (`proxy.migration_limit`; 0: never).
    pub migration_limit: u32,
    /// What happens when a prefill instance fails before the hand-off (`proxy.prefill_retry`).
    pub prefill_retry: pdserve_runtime::config::PrefillRetry,
    /// How instances are picked (`proxy.router`).
    pub router: pdserve_runtime::config::RouterKind,
    /// Weight of prefill work in the KV router's cost (`proxy.prefill_load_scale`).
    pub prefill_load_scale: f64,
    /// Bound on the hashes indexed per instance (`proxy.kv_index_max_blocks`).
    pub kv_index_max_blocks: usize,
    /// What the KV router credits a prefix block held in a KV tier (`proxy.kv_tier_credit`).
    pub kv_tier_credit: pdserve_runtime::config::TierCredit,
    /// The tokenizer of `proxy.model`: text and chat prompts become token ids for the KV
    /// router (without it, only token-id prompts are matched).
    pub tokenizer: Option<std::sync::Arc<super::state::PromptTokenizer>>,
}

impl ProxyArgs {
    /// A proxy on `bind` in front of these instances, with the config's defaults for the rest
    /// (upstream calls bounded at 600 s, no conditional disaggregation, no API key, one
    /// migration per request, prefill retry `retry`).
    pub fn new(bind: SocketAddr, prefill: Vec<String>, decode: Vec<String>) -> Self {
        let d = pdserve_runtime::config::ProxySection::default();
        Self {
            bind,
            prefill,
            decode,
            encode: Vec::new(),
            timeout: Duration::from_secs(d.timeout_s),
            max_prefill_queue: d.max_prefill_queue,
            max_concurrent_requests: d.max_concurrent_requests,
            conn_limits: crate::http::ConnLimits {
                max_connections: d.max_connections,
                header_read_timeout: Duration::from_secs(d.header_read_timeout_s),
            },
            api_key: None,
            call_timeout: Duration::from_millis(d.actor_call_timeout_ms),
            tls: crate::http::HttpTls::default(),
            migration_limit: d.migration_limit,
            prefill_retry: d.prefill_retry,
            router: d.router,
            prefill_load_scale: d.prefill_load_scale,
            kv_index_max_blocks: d.kv_index_max_blocks,
            kv_tier_credit: d.kv_tier_credit,
            tokenizer: None,
        }
    }

    pub(super) fn call_ms(&self) -> u64 {
        self.call_timeout.as_millis() as u64
    }
}

/// The proxy's control plane: where instances register and `pdserve inspect` connects.
#[derive(Clone, Debug)]
pub struct ProxyControlArgs {
    /// The proxy's member credentials (its node name is the certificate's).
    pub credentials: MemberCredentials,
    /// Where the control endpoint listens (UDP; port 0 picks one).
    pub listen: SocketAddr,
    /// Bound on fetching one instance's snapshot for `inspect`.
    pub inspect_timeout: Duration,
    /// Requests from members answered at once, over every connection (registration,
    /// draining, inspect, anything refused as unsupported); past it a request is answered
    /// `overloaded` at once instead of starting another task. Default
    /// [`MAX_CONTROL_REQUESTS`](crate::control_plane::MAX_CONTROL_REQUESTS).
    pub max_requests: usize,
    /// Membership in etcd: keep this proxy's record there (instances find it and register)
    /// and route only to instances whose record is alive.
    pub discovery: Option<crate::discovery::EtcdSettings>,
    /// The IP the proxy's etcd record publishes in place of the bound one (`proxy.advertise_addr`:
    /// a proxy bound to `0.0.0.0` in a pod publishes its pod IP). `None`: the bound addresses.
    pub advertise: Option<std::net::IpAddr>,
}

impl ProxyControlArgs {
    /// Control-plane settings with a 2 s inspect timeout.
    pub fn new(credentials: MemberCredentials, listen: SocketAddr) -> Self {
        Self {
            credentials,
            listen,
            inspect_timeout: Duration::from_secs(2),
            max_requests: crate::control_plane::MAX_CONTROL_REQUESTS,
            discovery: None,
            advertise: None,
        }
    }
}

/// Everything a Proxy is started from.
#[derive(Clone, Debug)]
pub struct ProxyStart {
    /// HTTP side and static instances.
    pub args: ProxyArgs,
    /// The control plane, if the cluster has credentials.
    pub control: Option<ProxyControlArgs>,
}

impl From<ProxyArgs> for ProxyStart {
    fn from(args: ProxyArgs) -> Self {
        Self {
            args,
            control: None,
        }
    }
}

/// What the ProxySupervisor knows of its child, for `inspect`.
#[derive(Debug, Clone, Default)]
pub struct SupervisedFigures {
    /// Restarts so far.
    pub restarts: u32,
    /// The last failure.
    pub last_error: Option<String>,
}
