//! The `rdma` backend (cargo feature `rdma`): one-sided RDMA READ/WRITE with ibverbs.
//!
//! Without the feature, or on a machine where `ibv_devices` lists no device, creating an
//! `rdma` engine fails with [`TransportError::Unsupported`].

use std::sync::Arc;

use crate::engine::{Backend, EngineCore};
use crate::error::Result;
#[cfg(not(feature = "rdma"))]
use crate::error::TransportError;

#[cfg(feature = "rdma")]
#[path = "rdma_verbs.rs"]
mod verbs;

/// Whether an RDMA device is present (always false without the `rdma` feature).
pub(crate) fn device_available() -> bool {
    #[cfg(feature = "rdma")]
    {
        verbs::device_available()
    }
    #[cfg(not(feature = "rdma"))]
    {
        false
    }
}

pub(crate) fn new_backend(core: &Arc<EngineCore>) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "rdma")]
    {
        verbs::RdmaBackend::new(core).map(|b| Box::new(b) as Box<dyn Backend>)
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = core;
        Err(TransportError::Unsupported(
            "this build has no rdma backend (cargo feature `rdma`)".into(),
        ))
    }
}
