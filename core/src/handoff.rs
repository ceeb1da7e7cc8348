//! The pure parts of the P/D hand-off: the one error of a hand-off, the joining of its
//! per-rank reports, and the choice of the KV path at the handshake (host path or CUDA IPC,
//! [`kv_path`]). The peer protocol's frames, the hand-off cores that plan byte spans
//! (`PullCore`, `PushTracker`, `plan.rs`) and the actors stay in `pdserve_actors::handoff`:
//! their types carry the model's KV layout and sampling parameters (`pdserve-gpu`) and the
//! transfer engine's operations (`pdserve-transport`, which runs on tokio).

mod aggregation;
mod error;
pub mod kv_path;

pub use aggregation::{
    next_attempt, Aggregation, Applied, Epochs, HandoffOutcome, RankReport, Tag,
};
pub use error::HandoffError;
