//! The supervised actors of a pdserve instance and of the proxy, and the P/D hand-off
//! between instances. See `docs/architecture.md` for the map.
//!
//! | module | what it holds |
//! |---|---|
//! | [`instance`] | starting and (in phases) stopping one instance |
//! | [`supervisor`] | the InstanceSupervisor and its restart policy |
//! | [`scheduler`] | the Scheduler actor over its pure core, and its typed handle |
//! | [`worker`] | the TpWorker actor (one TP rank on an executor thread) |
//! | [`handoff`] | the P/D hand-off: peer protocol, pure cores, KvSender, KvReceiver, Aggregator |
//! | [`http`] | the HttpFrontend actor: the OpenAI API and the peer protocol's HTTP adapter |
//! | [`control_plane`] | an instance's side of the control plane |
//! | [`proxy`] | the ProxySupervisor and Proxy: the cluster's front door |
//! | [`openai`] | OpenAI request parsing and response shapes (pure) |
//! | [`tools`] | chat tool calling: tools in the prompt, forced calls, calls parsed (pure) |
//! | [`multimodal`] | image input: limits, `data:` URLs, encoding, the prompt's image places |
//! | [`encode`] | encoder disaggregation: encode instances, the encoder protocol, fetching embeddings |
//! | [`block_manager`], [`kv_events`] | re-exported from `pdserve-core` (the block pool, the KV events) |
//! | [`mailbox`], [`timers`], [`error`] | shared pieces: counted addresses, timers that end with their actor, errors |

pub mod control_plane;
pub mod discovery;
pub mod encode;
pub mod error;
pub mod handoff;
pub mod http;
pub mod instance;
mod json_field;
pub mod kv_tiers;
pub mod mailbox;
pub mod multimodal;
pub mod openai;
pub mod proxy;
pub mod scheduler;
pub mod supervisor;
pub mod timers;
pub mod tools;
mod transfer_config;
pub mod worker;

pub use error::{RequestError, StartError};
pub use instance::{Instance, InstanceOptions, ShutdownReport};
pub use pdserve_core::{block_manager, kv_events};
