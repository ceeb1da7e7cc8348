//! The operations a caller submits: [`TransferOp`]s, each a read or a write ([`OpKind`])
//! between a local and a remote registered region.

use crate::memory::RegionId;

/// Direction of one operation, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Copy remote bytes into the local region.
    Read,
    /// Copy local bytes into the remote region.
    Write,
}

/// One operation of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferOp {
    /// Read or write.
    pub kind: OpKind,
    /// A region registered with this engine.
    pub local_region: RegionId,
    /// Byte offset in the local region.
    pub local_offset: u64,
    /// A region of the peer (from [`Session::remote_regions`](crate::Session::remote_regions)).
    pub remote_region: RegionId,
    /// Byte offset in the remote region.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

impl TransferOp {
    /// A write of `len` bytes from `local` at `lo` to `remote` at `ro`.
    pub fn write(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> Self {
        Self {
            kind: OpKind::Write,
            local_region: local,
            local_offset: lo,
            remote_region: remote,
            remote_offset: ro,
            len,
        }
    }

    /// A read of `len` bytes from `remote` at `ro` into `local` at `lo`.
    pub fn read(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> Self {
        Self {
            kind: OpKind::Read,
            local_region: local,
            local_offset: lo,
            remote_region: remote,
            remote_offset: ro,
            len,
        }
    }
}
