//! The supervised actors of a pdserve instance: `InstanceSupervisor`, `Scheduler`,
//! `TpWorker` × tp and `HttpFrontend` (the P/D actors — KvSender, KvReceiver, Aggregator,
//! Proxy — join them with the disaggregation work). See `../shared/DESIGN.md`.

pub mod block_manager;
pub mod error;
pub mod http;
pub mod instance;
pub mod kv_receiver;
pub mod kv_transfer;
pub mod openai;
pub mod proxy;
pub mod scheduler;
pub mod supervisor;
pub mod worker;

pub use error::RequestError;
pub use instance::{Instance, InstanceOptions};
