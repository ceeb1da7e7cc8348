//! [`AppState`]: what every handler of an instance's HTTP API shares.

use crate::error::RequestError;
use crate::handoff::{KvContext, PeerService};
use crate::scheduler::SchedulerHandle;
use pdserve_gpu::chat::ChatTemplate;
use pdserve_gpu::tokenizer::Tokenizer;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What every handler shares.
pub struct AppState {
    /// The instance's scheduler.
    pub scheduler: SchedulerHandle,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template.
    pub chat_template: ChatTemplate,
    /// Served model name.
    pub model_name: String,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Vocabulary size (for validating token ids).
    pub vocab_size: usize,
    /// Admission bound (shared with the peer protocol's prefills); closed when the instance
    /// stops admitting.
    pub admission: Arc<Semaphore>,
    /// Per-request deadline.
    pub request_timeout: Duration,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Prometheus registry.
    pub metrics: pdserve_runtime::telemetry::MetricsHandle,
    /// The KV hand-off context (instances with a transfer engine).
    pub kv: Option<Arc<KvContext>>,
    /// The peer protocol's service (instances with a transfer engine).
    pub peer: Option<Arc<PeerService<SchedulerHandle>>>,
    /// Where this frontend listens (set once bound).
    pub addr: std::sync::OnceLock<SocketAddr>,
    /// HTTPS of this API, and the scheme of peers named by host and port alone.
    pub tls: super::HttpTls,
    /// Whether the instance takes new requests (cleared when it stops: `/health` says so).
    pub ready: AtomicBool,
}

impl AppState {
    /// Takes an admission slot.
    ///
    /// # Errors
    /// [`RequestError::Overloaded`] when every slot is taken; [`RequestError::ShuttingDown`]
    /// once the instance stopped admitting.
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, RequestError> {
        self.admission
            .clone()
            .try_acquire_owned()
            .map_err(|e| match e {
                tokio::sync::TryAcquireError::Closed => RequestError::ShuttingDown,
                tokio::sync::TryAcquireError::NoPermits => RequestError::Overloaded(format!(
                    "{} requests in flight",
                    self.admission.available_permits()
                )),
            })
    }

    /// The instance's control-plane address (published in `kv_transfer_params` so a decode
    /// instance can reach the peer protocol there).
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.kv
            .as_ref()?
            .peers
            .control_endpoint()?
            .local_addr()
            .ok()
    }
}
