//! The backends behind [`crate::TransferEngine`]; each implements the crate-private
//! `Backend`/`Link` traits of the engine's seam (`seam.rs`), never the facade itself, and
//! passes the same conformance suite.

pub(crate) mod codec;
pub(crate) mod fd_pass;
pub(crate) mod local;
pub(crate) mod peer_proc;
pub(crate) mod proto;
pub(crate) mod quic;
pub(crate) mod rdma;
pub(crate) mod shm;
pub(crate) mod tcp;
