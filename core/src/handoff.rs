//! The pure parts of the P/D hand-off: the one error of a hand-off, the joining of its
//! per-rank reports, the choice of the KV path at the handshake (host path or CUDA IPC,
//! [`kv_path`]), the decode side of one hand-off as a state machine ([`pull::PullCore`]) and
//! the bounded memory of recently aborted hand-offs ([`aborts::RecentAborts`]).
//!
//! The peer protocol's frames, the prefill side's `PushTracker` and the byte-span planning
//! (`plan.rs`) stay in `pdserve_actors::handoff` for now: their types carry the model's KV
//! layout and sampling parameters (`pdserve-gpu`) and the transfer engine's operations
//! (`pdserve-transport`, which runs on tokio).

pub mod aborts;
mod aggregation;
mod error;
pub mod kv_path;
pub mod pull;

pub use aggregation::{
    next_attempt, Aggregation, Applied, Epochs, HandoffOutcome, RankReport, Tag,
};
pub use error::HandoffError;
pub use pull::PullCore;
