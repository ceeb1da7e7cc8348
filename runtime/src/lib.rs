//! pdserve's foundation crate: what every other crate shares.
//!
//! It grows with the actor runtime (config layers, ids, protocol types, the control-plane
//! codec, supervision helpers and the supervision-tree snapshot); see `docs/architecture.md`.

/// The pdserve version, part of the compatibility hash two instances compare at handshake.
pub const PDSERVE_VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod config;
pub mod deployment;
pub mod error;
pub mod faults;
pub mod ids;
pub mod json;
pub mod memory;
pub mod role;
pub mod supervision;
pub mod telemetry;

pub use error::{ConfigError, RuntimeError};
pub use role::Role;
pub mod wire;
