//! pdserve's transfer engine and control plane.
//!
//! The **transfer engine** ([`TransferEngine`]) moves bytes between registered memory regions
//! of two instances and knows nothing of what they hold (as Mooncake's transfer engine):
//! register memory ([`TransferEngine::register`]), open a [`Session`] to a peer (which fetches
//! and validates its region descriptors), submit batches of [`TransferOp`]s and wait for or poll
//! their [`BatchHandle`], send [`Session::notify`] messages. Backends, picked by
//! [`TransferConfig::backend`]: `local`, `shm`, `tcp`, `quic`, `rdma` (feature).
//!
//! The **control plane** ([`control`]) connects cluster members over mutual-TLS QUIC and
//! carries the typed messages of `pdserve_runtime::wire`.
//!
//! See `docs/transport.md` for the design, guarantees and measured performance.

pub mod auth;
mod backend;
mod batch;
pub mod bench;
mod config;
pub mod control;
mod engine;
mod error;
mod integrity;
mod keys;
mod memcpy;
pub mod memory;
mod op;
#[doc(hidden)]
pub mod peer;
mod plan;
mod seam;

pub use auth::{
    Access, FenceId, FenceScope, RegionGrant, SessionCredentials, SessionGrant, SessionGrantGuard,
    SessionKey,
};
pub use batch::{BatchHandle, BatchStatus};
pub use config::{BackendKind, RdmaConfig, TcpIntegrity, TransferConfig};
pub use engine::{BackendAvailability, Session, TransferEngine};
pub use error::{Result, Side, TransportError};
#[doc(hidden)]
pub use memcpy::CopyHold;
pub use memory::{RegionId, RegisteredRegion, ShmAllocator, ShmMemory};
pub use op::{OpKind, TransferOp};
pub use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
pub use plan::coalesce;
pub use seam::Notification;
