//! The supervised actors of a pdserve instance: `InstanceSupervisor`, `Scheduler`,
//! `TpWorker` × tp, `HttpFrontend`, and for the P/D roles `KvSender`, `KvReceiver` and
//! `Aggregator`; the `Proxy` fronts a cluster. See `../shared/DESIGN.md`.

pub mod aggregator;
pub mod block_manager;
pub mod control_plane;
pub mod error;
pub mod http;
pub mod instance;
pub mod kv_receiver;
pub mod kv_sender;
pub mod kv_transfer;
pub mod mailbox;
pub mod openai;
pub mod proxy;
pub mod scheduler;
pub mod supervisor;
pub mod worker;

pub use error::RequestError;
pub use instance::{Instance, InstanceOptions};
