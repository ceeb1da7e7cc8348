//! Errors a request can end with, and their one mapping to HTTP status codes.

/// Why a request did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request is malformed or asks for something impossible (400).
    #[error("{0}")]
    BadRequest(String),
    /// Prompt plus requested tokens exceed the model's context (400).
    #[error("This model's maximum context length is {max} tokens. However, you requested {requested} tokens ({prompt} in the prompt, {completion} for the completion). Please reduce the prompt or max_tokens.")]
    ContextOverflow {
        /// The model's context.
        max: usize,
        /// Prompt + max_tokens.
        requested: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Completion tokens asked for.
        completion: usize,
    },
    /// The named model is not served here (400).
    #[error("The model `{0}` does not exist on this server.")]
    UnknownModel(String),
    /// Admission refused: too many requests in flight (503).
    #[error("server overloaded: {0}")]
    Overloaded(String),
    /// The compute worker holding the request failed (500).
    #[error("worker failure: {0}")]
    WorkerFailed(String),
    /// Moving the prompt's KV from the prefill instance failed (502).
    #[error("KV transfer from the prefill instance failed: {0}")]
    KvTransfer(crate::handoff::HandoffError),
    /// Taking the request's image embeddings from its encode instance failed (502).
    #[error("image embeddings from encoder {encoder}: {error}")]
    Encoder {
        /// The encode instance's URL.
        encoder: String,
        /// Why.
        error: crate::encode::protocol::EncoderError,
    },
    /// The proxy could not reach the instance it picked (502).
    #[error("upstream instance unavailable: {0}")]
    Upstream(String),
    /// The caller may not do this from where it calls (403).
    #[error("{0}")]
    Forbidden(String),
    /// The instance is stopping (503).
    #[error("instance is shutting down")]
    ShuttingDown,
    /// The request ran past its deadline (504).
    #[error("request timed out after {0} s")]
    Timeout(u64),
    /// The client went away or aborted (nothing is sent back).
    #[error("request aborted")]
    Aborted,
    /// A bug or an unexpected state (500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl RequestError {
    /// The HTTP status for this error — the only place errors become status codes.
    pub fn status(&self) -> u16 {
        match self {
            Self::BadRequest(_) | Self::ContextOverflow { .. } | Self::UnknownModel(_) => 400,
            Self::Overloaded(_) | Self::ShuttingDown => 503,
            Self::Timeout(_) => 504,
            Self::KvTransfer(_) | Self::Upstream(_) | Self::Encoder { .. } => 502,
            Self::Aborted => 499,
            Self::Forbidden(_) => 403,
            Self::WorkerFailed(_) | Self::Internal(_) => 500,
        }
    }

    /// A stable name for metrics and logs (also the OpenAI error `type`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BadRequest(_) | Self::ContextOverflow { .. } => "invalid_request_error",
            Self::UnknownModel(_) => "model_not_found",
            Self::Overloaded(_) => "overloaded",
            Self::ShuttingDown => "shutting_down",
            Self::Forbidden(_) => "forbidden",
            Self::Timeout(_) => "timeout",
            Self::Aborted => "aborted",
            Self::WorkerFailed(_) => "worker_failed",
            Self::KvTransfer(_) => "kv_transfer_failed",
            Self::Encoder { .. } => "encoder_failed",
            Self::Upstream(_) => "upstream_error",
            Self::Internal(_) => "internal_error",
        }
    }
}

/// Why an instance, a proxy or one of their parts could not start, or a setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// A setting is missing, malformed or inconsistent.
    #[error("{key}: {message}")]
    Config {
        /// The config key (or flag) at fault.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The control plane could not start (credentials, binding).
    #[error("control plane: {0}")]
    ControlPlane(String),
    /// The transfer engine could not start, or KV memory could not be registered.
    #[error("transfer engine: {0}")]
    Transfer(String),
    /// An actor failed to start (model sharding, memory, binding), or did not answer.
    #[error("{what}: {message}")]
    Actor {
        /// Which part.
        what: String,
        /// Its failure.
        message: String,
    },
}

impl StartError {
    /// A stable name of the failure, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config { .. } => "config",
            Self::ControlPlane(_) => "control_plane",
            Self::Transfer(_) => "transfer",
            Self::Actor { .. } => "actor",
        }
    }

    /// A config failure of `key`.
    pub fn config(key: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self::Config {
            key: key.into(),
            message: message.to_string(),
        }
    }

    /// An actor failure of `what`.
    pub fn actor(what: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self::Actor {
            what: what.into(),
            message: message.to_string(),
        }
    }
}
