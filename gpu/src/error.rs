//! The one error type of the `gpu` crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
///
/// Each variant has a stable [`ModelError::kind`] string for metrics and logs.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file or directory does not exist.
    #[error("model not found: {path}")]
    NotFound {
        /// Path that was looked up.
        path: PathBuf,
    },
    /// The file exists but could not be read, or is not a valid GGUF/safetensors file.
    #[error("corrupt or unreadable model file {path}: {reason}")]
    Corrupt {
        /// The offending file.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// The model's architecture is not a Llama-family decoder we can run.
    #[error("unsupported architecture `{0}` (supported: llama, qwen2, mistral, smollm)")]
    UnsupportedArchitecture(String),
    /// A tensor is stored in a type we do not run.
    #[error("tensor `{name}` has unsupported type {dtype}")]
    UnsupportedTensorType {
        /// Tensor name in the file.
        name: String,
        /// Its stored type.
        dtype: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("tensor `{0}` is missing from the model")]
    MissingTensor(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Shape found.
        actual: Vec<usize>,
        /// Shape expected.
        expected: Vec<usize>,
    },
    /// A required metadata key or config field is absent or has the wrong type.
    #[error("model metadata `{0}` is missing or invalid")]
    BadMetadata(String),
    /// Tensor parallel degree does not split the model evenly.
    #[error("tensor parallel size {tp} does not divide {what} ({count})")]
    BadTpSize {
        /// Requested TP degree.
        tp: usize,
        /// Which dimension failed to split ("KV heads", "attention heads", ...).
        what: &'static str,
        /// The size of that dimension.
        count: usize,
    },
    /// The prompt plus requested tokens exceed the model context.
    #[error("sequence of {tokens} tokens exceeds the model context of {context} tokens")]
    ContextOverflow {
        /// Tokens requested.
        tokens: usize,
        /// Context length of the model.
        context: usize,
    },
    /// The KV cache has no room for the request.
    #[error("KV cache out of blocks: needed {needed}, free {free}")]
    OutOfBlocks {
        /// Blocks needed.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A batch passed to the forward pass is malformed (block table too short, bad position).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// Tokenizer construction or encoding/decoding failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// Fetching the default model failed.
    #[error("model fetch failed: {0}")]
    Fetch(String),
    /// Invalid sampling parameters.
    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),
    /// A structured-output grammar (JSON schema, regex, choice, Lark) is out of bounds, cannot
    /// be compiled, or the sequence left it.
    #[error("invalid grammar: {0}")]
    InvalidGrammar(String),
    /// A tensor-parallel rank thread died or stopped answering.
    #[error("tensor-parallel rank {rank} failed: {reason}")]
    RankFailed {
        /// Which rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// An error from the tensor library.
    #[error("tensor library: {0}")]
    Candle(#[from] candle_core::Error),
    /// An image was refused or does not decode (vision-language models).
    #[error(transparent)]
    Image(#[from] crate::vision::ImageError),
    /// Filesystem error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The requested device cannot be used, or a device operation failed (CUDA).
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
}

impl ModelError {
    /// A short, stable name for this error's kind, for metrics labels and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotFound { .. } => "not_found",
            Self::Corrupt { .. } => "corrupt",
            Self::UnsupportedArchitecture(_) => "unsupported_architecture",
            Self::UnsupportedTensorType { .. } => "unsupported_tensor_type",
            Self::MissingTensor(_) => "missing_tensor",
            Self::BadShape { .. } => "bad_shape",
            Self::BadMetadata(_) => "bad_metadata",
            Self::BadTpSize { .. } => "bad_tp_size",
            Self::ContextOverflow { .. } => "context_overflow",
            Self::OutOfBlocks { .. } => "out_of_blocks",
            Self::InvalidBatch(_) => "invalid_batch",
            Self::Tokenizer(_) => "tokenizer",
            Self::ChatTemplate(_) => "chat_template",
            Self::Fetch(_) => "fetch",
            Self::InvalidSampling(_) => "invalid_sampling",
            Self::InvalidGrammar(_) => "invalid_grammar",
            Self::RankFailed { .. } => "rank_failed",
            Self::Candle(_) => "tensor_library",
            Self::Image(e) => e.kind(),
            Self::Io(_) => "io",
            Self::Device(e) => e.kind(),
        }
    }
}

/// Result alias for the `gpu` crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
