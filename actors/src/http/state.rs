//! [`AppState`]: what every handler of an instance's HTTP API shares.

use crate::error::RequestError;
use crate::handoff::{KvContext, PeerService};
use crate::scheduler::SchedulerHandle;
use pdserve_gpu::chat::ChatTemplate;
use pdserve_gpu::tokenizer::Tokenizer;
use pdserve_runtime::telemetry as m;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// What every handler shares.
pub struct AppState {
    /// The instance's scheduler.
    pub scheduler: SchedulerHandle,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template.
    pub chat_template: ChatTemplate,
    /// Served model name: the primary one, which responses carry.
    pub model_name: String,
    /// Every served name (`model.name`, first = `model_name`), as `GET /v1/models` lists them.
    pub served_names: Vec<String>,
    /// The model's own name (its file's), accepted beside the served names.
    pub own_model_name: String,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Vocabulary size (for validating token ids).
    pub vocab_size: usize,
    /// Admission bound (shared with the peer protocol's prefills); closed when the instance
    /// stops admitting.
    pub admission: Arc<Semaphore>,
    /// Its size (`server.max_concurrent_requests`), for the refusal's message.
    pub max_concurrent_requests: usize,
    /// Bounds on the API's connections.
    pub conn_limits: super::ConnLimits,
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
    /// Whether the instance takes new requests (cleared when it drains or stops: `/health`
    /// says so, and new requests get 503 `instance is shutting down`).
    pub ready: AtomicBool,
    /// Cancelled when a drain is asked for over the API (`POST /drain`); whoever owns the
    /// instance (`pdserve serve`) then stops it in phases, as on SIGTERM.
    pub drain: CancellationToken,
    /// The vision tower of a vision-language model (`None`: images are refused).
    pub vision: Option<Arc<pdserve_gpu::vision::VisionTower>>,
    /// Limits on image input (`[multimodal]`).
    pub multimodal: pdserve_runtime::config::MultimodalSection,
    /// An encode instance's protocol service (`instance.role = "encode"`).
    pub encoder: Option<Arc<crate::encode::EncoderService>>,
    /// Takes image embeddings from encode instances (a vision-language model with a transfer
    /// engine).
    pub images: Option<Arc<crate::encode::ImageResolver>>,
    /// The VisionEncoder of a vision-language model: where this instance's images are
    /// encoded.
    pub vision_encoder: Option<crate::encode::VisionEncoderHandle>,
}

impl AppState {
    /// Whether a request's `model` names this instance's model: a served name or the
    /// model's own.
    pub fn serves_model(&self, name: &str) -> bool {
        name == self.own_model_name || self.served_names.iter().any(|n| n == name)
    }

    /// Takes an admission slot.
    ///
    /// # Errors
    /// [`RequestError::Overloaded`] when every slot is taken; [`RequestError::ShuttingDown`]
    /// once the instance stopped admitting.
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, RequestError> {
        let shed = |reason: &'static str, e: RequestError| {
            metrics::counter!(m::REQUESTS_SHED_TOTAL, m::LABEL_REASON => reason).increment(1);
            e
        };
        if !self.is_ready() {
            return Err(shed("shutting_down", RequestError::ShuttingDown));
        }
        self.admission
            .clone()
            .try_acquire_owned()
            .map_err(|e| match e {
                tokio::sync::TryAcquireError::Closed => {
                    shed("shutting_down", RequestError::ShuttingDown)
                }
                tokio::sync::TryAcquireError::NoPermits => shed(
                    "requests",
                    RequestError::Overloaded(format!(
                        "{} requests in flight (server.max_concurrent_requests)",
                        self.max_concurrent_requests
                    )),
                ),
            })
    }

    /// Whether the instance takes new requests (not draining, not stopping).
    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Starts a drain: new requests are refused from now on (`/health` answers 503
    /// `draining`), and the owner is told to stop the instance in phases.
    pub fn start_drain(&self) {
        self.ready.store(false, std::sync::atomic::Ordering::SeqCst);
        self.drain.cancel();
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
