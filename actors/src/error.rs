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
    KvTransfer(String),
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
            Self::KvTransfer(_) => 502,
            Self::Aborted => 499,
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
            Self::Timeout(_) => "timeout",
            Self::Aborted => "aborted",
            Self::WorkerFailed(_) => "worker_failed",
            Self::KvTransfer(_) => "kv_transfer_failed",
            Self::Internal(_) => "internal_error",
        }
    }
}
