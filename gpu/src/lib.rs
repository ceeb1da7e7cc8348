//! Model execution for pdserve: weights loading (GGUF, safetensors), tokenizer and chat
//! template, the paged KV cache, the forward pass over mixed prefill/decode batches,
//! tensor parallelism across CPU threads, and sampling.
//!
//! This crate knows nothing of actors or networks; `pdserve-actors` drives it.

mod error;
pub use error::{ModelError, Result};

pub mod chat;
pub mod fetch;
pub mod grammar;
pub mod sampling;
pub mod tokenizer;
pub use chat::{ChatMessage, ChatTemplate};
pub use sampling::{FinishReason, Sampler, SamplingParams, StopChecker, StopDecision, StopReason};
pub use tokenizer::{DecodeStream, Tokenizer};

pub mod attention;
pub mod batch;
pub mod bench;
pub mod collective;
pub mod config;
pub mod cuda;
pub mod device;
pub mod engine;
pub mod generation;
pub mod hf_config;
pub mod hf_vlm;
pub mod kv;
pub mod loader;
pub(crate) mod loose;
pub mod mmproj;
pub mod model;
pub mod quant;
pub mod synthetic;
pub mod tp;
pub mod vecmath;
pub mod vision;
pub mod weights;
