//! The P/D hand-off: how a prompt's KV cache moves from a prefill instance to a decode
//! instance, read as one protocol and two state machines.
//!
//! | module | what it holds |
//! |---|---|
//! | [`protocol`] | the typed peer protocol (`PeerRequest` → `PeerAnswer`, rkyv frames) and its one error, [`HandoffError`] |
//! | [`plan`] | pure checks and planning: layout validation, block lists, (layer, K/V, block, heads) → byte spans |
//! | [`pull`] | [`PullCore`] (in `pdserve-core`): the decode side of one hand-off (pull reads, or waiting for a push), events in, actions out |
//! | [`push`] | [`PushTracker`]: the prefill side of layerwise pushes, events in, actions out |
//! | [`aggregator`] | the Aggregator actor: joins per-rank reports, fenced by epochs and attempts |
//! | [`peer`] | the client side of the protocol: carriers (control plane, HTTP), cached handshakes and sessions, lease renewal |
//! | [`service`] | [`PeerService`]: what an instance answers to the protocol (the prefill side) |
//! | [`session`] | authenticated transfer sessions: grants, keys, one fenced scope per hand-off |
//! | [`receiver`] | the KvReceiver actor: one driver task per decode-side hand-off running a [`PullCore`] |
//! | [`sender`] | the KvSender actor: drives the [`PushTracker`] |
//! | [`context`] | [`KvContext`]: what both actors share about their instance |
//! | [`device_kv`] | the [`device_kv::DeviceKvPeer`] seam of a rank whose KV lives on a GPU, and our KV placement from it |
//! | [`host_proof`] | [`host_proof::HostProofs`]: how a peer's claim to run on this host is verified |
//! | [`device`] | device KV: the placement exchange and CUDA IPC reads (same-GPU P/D); re-exports the seam and host proofs |
//!
//! Dependencies point one way: this module knows nothing of the Scheduler (the service reaches
//! it through [`service::PrefillHost`], the receiver answers through a [`receiver::FetchReply`]
//! callback), and the Scheduler depends on it.

pub use pdserve_core::handoff::aborts;
pub mod aggregator;
pub mod context;
pub mod device;
pub mod device_kv;
pub mod host_proof;
pub mod peer;
pub mod plan;
pub mod protocol;
pub use pdserve_core::handoff::pull;
pub mod push;
pub mod receiver;
pub mod sender;
pub mod service;
pub mod session;

pub use context::{KvContext, KvFigures, KvRegistry, KvSettings, TransferMode};
pub use protocol::HandoffError;
pub use pull::PullCore;
pub use push::PushTracker;
pub use service::{Caller, PeerService};
