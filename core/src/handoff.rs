//! The pure parts of the P/D hand-off: the one error of a hand-off and the joining of its
//! per-rank reports. The peer protocol's frames, the hand-off cores that plan byte spans
//! (`PullCore`, `PushTracker`, `plan.rs`) and the actors stay in `pdserve_actors::handoff`:
//! their types carry the model's KV layout and sampling parameters (`pdserve-gpu`) and the
//! transfer engine's operations (`pdserve-transport`, which runs on tokio).

mod aggregation;
mod error;

pub use aggregation::{
    next_attempt, Aggregation, Applied, Epochs, HandoffOutcome, RankReport, Tag,
};
pub use error::HandoffError;
