//! Planning a batch: operations merged where they continue each other ([`coalesce`]), checked
//! against the local registry and the peer's descriptors, and cut into [`PlannedOp`] pieces
//! that lie inside one registration chunk on each side and move at most `piece_bytes` each.

use std::collections::HashMap;
use std::sync::Arc;

use pdserve_runtime::wire::{RegionChunk, RegionDescriptor};

use crate::auth::FenceId;
use crate::error::{Result, Side, TransportError};
use crate::memory::{check_range, RegionEntry, RegionId, Registry};
use crate::op::{OpKind, TransferOp};

/// Merges operations that continue each other (same kind and regions, contiguous on both
/// sides), keeping the order of first appearance. Zero-length operations are dropped.
pub fn coalesce(ops: &[TransferOp]) -> Vec<TransferOp> {
    let mut out: Vec<TransferOp> = Vec::with_capacity(ops.len());
    for op in ops.iter().filter(|o| o.len > 0) {
        if let Some(last) = out.last_mut() {
            if last.kind == op.kind
                && last.local_region == op.local_region
                && last.remote_region == op.remote_region
                && last.local_offset.checked_add(last.len) == Some(op.local_offset)
                && last.remote_offset.checked_add(last.len) == Some(op.remote_offset)
            {
                last.len += op.len;
                continue;
            }
        }
        out.push(*op);
    }
    out
}

/// A planned piece: inside one registration chunk on each side, at most `piece_bytes` long.
#[derive(Debug, Clone)]
pub(crate) struct PlannedOp {
    pub(crate) kind: OpKind,
    pub(crate) local: Arc<RegionEntry>,
    pub(crate) local_offset: u64,
    pub(crate) remote_region: RegionId,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    /// The scope at the target the piece belongs to.
    pub(crate) fence: FenceId,
    /// The remote chunk holding the piece (RDMA address and key).
    #[allow(dead_code)]
    pub(crate) remote_chunk: RegionChunk,
}

fn chunk_end(chunks: &[RegionChunk], offset: u64) -> Option<(RegionChunk, u64)> {
    chunks
        .iter()
        .find(|c| c.offset <= offset && offset < c.offset + c.len)
        .map(|c| (c.clone(), c.offset + c.len))
}

/// Checks `ops` against the local registry and the peer's descriptors (`remote`, as last
/// fetched), coalesces them and cuts them into pieces of scope `fence`: inside one
/// registration chunk on each side, at most `piece_bytes` long. Returns the pieces and the
/// bytes they move.
///
/// # Errors
/// [`TransportError::UnknownRegion`] / [`TransportError::OutOfBounds`] (local or remote);
/// [`TransportError::LayoutMismatch`] when chunks do not cover a region.
pub(crate) fn plan(
    ops: &[TransferOp],
    registry: &Registry,
    remote: &HashMap<RegionId, RegionDescriptor>,
    piece_bytes: u64,
    fence: FenceId,
) -> Result<(Vec<PlannedOp>, u64)> {
    let ops = coalesce(ops);
    let piece = piece_bytes;
    let mut pieces = Vec::new();
    let mut bytes = 0u64;
    for op in &ops {
        let local = registry.get(Side::Local, op.local_region)?;
        local.check(Side::Local, op.local_offset, op.len)?;
        let rdesc = remote
            .get(&op.remote_region)
            .ok_or(TransportError::UnknownRegion {
                side: Side::Remote,
                id: op.remote_region,
            })?;
        check_range(Side::Remote, rdesc.id, op.remote_offset, op.len, rdesc.len)?;
        bytes += op.len;
        let mut done = 0u64;
        while done < op.len {
            let lo = op.local_offset + done;
            let ro = op.remote_offset + done;
            let (_, lend) = chunk_end(&local.descriptor.chunks, lo).ok_or_else(|| {
                TransportError::LayoutMismatch("local chunks do not cover the region".into())
            })?;
            let (rchunk, rend) = chunk_end(&rdesc.chunks, ro).ok_or_else(|| {
                TransportError::LayoutMismatch(format!(
                    "peer region {} chunks leave a gap",
                    rdesc.id
                ))
            })?;
            let n = (op.len - done).min(piece).min(lend - lo).min(rend - ro);
            pieces.push(PlannedOp {
                kind: op.kind,
                local: local.clone(),
                local_offset: lo,
                remote_region: op.remote_region,
                remote_offset: ro,
                len: n,
                fence,
                remote_chunk: rchunk,
            });
            done += n;
        }
    }
    Ok((pieces, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_contiguous_runs_only() {
        let ops = [
            TransferOp::write(1, 0, 2, 100, 10),
            TransferOp::write(1, 10, 2, 110, 5),
            TransferOp::write(1, 15, 2, 200, 5), // remote not contiguous
            TransferOp::read(1, 20, 2, 205, 5),  // kind differs
            TransferOp::read(1, 25, 2, 210, 0),  // empty: dropped
            TransferOp::read(1, 25, 2, 210, 7),
        ];
        let out = coalesce(&ops);
        assert_eq!(
            out,
            vec![
                TransferOp::write(1, 0, 2, 100, 15),
                TransferOp::write(1, 15, 2, 200, 5),
                TransferOp::read(1, 20, 2, 205, 12),
            ]
        );
    }
}
