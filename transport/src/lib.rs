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
pub mod bench;
pub mod control;
mod engine;
mod error;
mod integrity;
pub mod memory;
#[doc(hidden)]
pub mod peer;

pub use auth::{
    Access, FenceId, FenceScope, RegionGrant, SessionCredentials, SessionGrant, SessionGrantGuard,
    SessionKey,
};
#[doc(hidden)]
pub use backend::memcpy::CopyHold;
pub use engine::{
    coalesce, BackendAvailability, BackendKind, BatchHandle, BatchStatus, Notification, OpKind,
    RdmaConfig, Session, TcpIntegrity, TransferConfig, TransferEngine, TransferOp,
};
pub use error::{Result, Side, TransportError};
pub use memory::{RegionId, RegisteredRegion, ShmAllocator, ShmMemory};
pub use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
