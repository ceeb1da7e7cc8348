//! How a (prefill blocks → decode blocks) hand-off becomes transfer-engine operations, and
//! the checks that come first.
//!
//! The receiving side validates the peer's published [`KvPeerInfo`] against its own
//! ([`validate_peer`]) and refuses a mismatch with a clear error instead of reading into the
//! wrong place; [`check_blocks`] checks a hand-off's block lists; [`plan_pull`] and
//! [`plan_slice`] map every (layer, K/V, block, head range) to byte spans on both sides.
//! Different TP sizes on the two sides (heterogeneous TP) are handled by intersecting head
//! ranges: a rank with half the heads reads half of each block from the rank that holds them.
//! Pure functions: no I/O, no actors.

use super::protocol::{HandoffError, KvPeerInfo};
use pdserve_gpu::kv::KvKind;
use pdserve_transport::TransferOp;
use std::ops::Range;

fn intersect(a: (usize, usize), b: (usize, usize)) -> Range<usize> {
    a.0.max(b.0)..a.1.min(b.1).max(a.0.max(b.0))
}

/// Checks a peer's published KV memory against ours.
///
/// # Errors
/// [`HandoffError::Incompatible`] for a different compatibility key;
/// [`HandoffError::LayoutMismatch`] naming what differs (layer count, block size, head
/// size, dtype, head coverage, region count).
pub fn validate_peer(ours: &KvPeerInfo, theirs: &KvPeerInfo) -> Result<(), HandoffError> {
    let mismatch = |reason: String| HandoffError::LayoutMismatch {
        peer: theirs.engine_id.clone(),
        reason,
    };
    if ours.compat_key != theirs.compat_key || ours.compat_hash != theirs.compat_hash {
        return Err(HandoffError::Incompatible {
            peer: theirs.engine_id.clone(),
            theirs: theirs.compat_key.clone(),
            ours: ours.compat_key.clone(),
        });
    }
    if theirs.ranks.is_empty() {
        return Err(mismatch("no TP ranks published".into()));
    }
    let reference = &ours.ranks[0].layout;
    // Block ids are shared by an instance's ranks, so every rank must hold the same pool: a
    // rank announcing fewer blocks would let an id checked against rank 0 run off its layout.
    let pool = theirs.ranks[0].layout.num_blocks;
    let mut covered = 0;
    for (r, rank) in theirs.ranks.iter().enumerate() {
        let l = &rank.layout;
        if l.num_layers != reference.num_layers {
            return Err(mismatch(format!(
                "rank {r} has {} layers, we have {}",
                l.num_layers, reference.num_layers
            )));
        }
        if l.block_size != reference.block_size {
            return Err(mismatch(format!(
                "rank {r} uses blocks of {} tokens, we use {}",
                l.block_size, reference.block_size
            )));
        }
        if l.num_blocks != pool {
            return Err(mismatch(format!(
                "rank {r} has a pool of {} blocks, rank 0 has {pool}",
                l.num_blocks
            )));
        }
        if l.head_dim != reference.head_dim || l.dtype != reference.dtype {
            return Err(mismatch(format!(
                "rank {r} stores {:?} heads of {}, we store {:?} heads of {}",
                l.dtype, l.head_dim, reference.dtype, reference.head_dim
            )));
        }
        if rank.heads.0 != covered
            || rank.heads.1 <= rank.heads.0
            || rank.heads.1 - rank.heads.0 != l.num_kv_heads
        {
            return Err(mismatch(format!(
                "rank {r} claims heads {:?} with {} heads in its layout",
                rank.heads, l.num_kv_heads
            )));
        }
        if rank.regions.len() != l.num_layers {
            return Err(mismatch(format!(
                "rank {r} publishes {} regions for {} layers",
                rank.regions.len(),
                l.num_layers
            )));
        }
        covered = rank.heads.1;
    }
    if covered != theirs.num_kv_heads || theirs.num_kv_heads != ours.num_kv_heads {
        return Err(mismatch(format!(
            "heads cover 0..{covered} of {} (we have {})",
            theirs.num_kv_heads, ours.num_kv_heads
        )));
    }
    Ok(())
}

/// Checks a hand-off's block lists: exactly the blocks `tokens` need on the remote side, at
/// least that many locally, every id inside its pool. Returns the number of blocks.
///
/// # Errors
/// [`HandoffError::InvalidBlocks`] naming what is wrong.
pub fn check_blocks(
    ours: &KvPeerInfo,
    theirs: &KvPeerInfo,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    tokens: usize,
) -> Result<usize, HandoffError> {
    let bs = ours.ranks[0].layout.block_size;
    let n = tokens.div_ceil(bs);
    if local_blocks.len() < n || remote_blocks.len() != n {
        return Err(HandoffError::InvalidBlocks(format!(
            "{tokens} tokens need {n} blocks; got {} remote and {} local",
            remote_blocks.len(),
            local_blocks.len()
        )));
    }
    // The smallest pool of any rank (validate_peer makes them equal; this holds without it).
    let pool = |info: &KvPeerInfo| info.ranks.iter().map(|r| r.layout.num_blocks).min();
    let remote_pool = pool(theirs).unwrap_or(0);
    if let Some(b) = remote_blocks.iter().find(|&&b| b as usize >= remote_pool) {
        return Err(HandoffError::InvalidBlocks(format!(
            "remote block {b} is outside the peer's pool of {remote_pool}"
        )));
    }
    let local_pool = pool(ours).unwrap_or(0);
    if let Some(b) = local_blocks.iter().find(|&&b| b as usize >= local_pool) {
        return Err(HandoffError::InvalidBlocks(format!(
            "local block {b} is outside our pool of {local_pool}"
        )));
    }
    Ok(n)
}

/// Which direction a planned hand-off moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Peer → us (decode pulls).
    Read,
    /// Us → peer (prefill pushes).
    Write,
}

/// What one slice of a hand-off covers: our rank, the layers, and which of the request's
/// blocks (indices into the block lists).
#[derive(Clone, Debug)]
pub struct Slice {
    /// Our TP rank.
    pub rank: usize,
    /// Layers.
    pub layers: Range<usize>,
    /// Block indices (into `local_blocks` / `remote_blocks`).
    pub blocks: Range<usize>,
}

/// The transfer operations moving one [`Slice`] of a request's KV between our
/// `local_blocks` and the peer's `remote_blocks`, for K and V, mapping our rank's heads onto
/// every peer rank that holds some of them (heterogeneous TP). Block lists must have been
/// checked with [`check_blocks`].
pub fn plan_slice(
    ours: &KvPeerInfo,
    theirs: &KvPeerInfo,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    slice: &Slice,
    direction: Direction,
) -> Vec<TransferOp> {
    let mine = &ours.ranks[slice.rank];
    let mut ops = Vec::new();
    for peer in &theirs.ranks {
        let heads = intersect(mine.heads, peer.heads);
        if heads.is_empty() {
            continue;
        }
        let local_heads = heads.start - mine.heads.0..heads.end - mine.heads.0;
        let remote_heads = heads.start - peer.heads.0..heads.end - peer.heads.0;
        for layer in slice.layers.clone() {
            for kind in [KvKind::Key, KvKind::Value] {
                for i in slice.blocks.clone() {
                    let l = mine.layout.span(
                        layer,
                        kind,
                        local_blocks[i] as usize,
                        local_heads.clone(),
                    );
                    let r = peer.layout.span(
                        layer,
                        kind,
                        remote_blocks[i] as usize,
                        remote_heads.clone(),
                    );
                    let (lr, lo, rr, ro, len) = (
                        mine.regions[layer],
                        l.offset as u64,
                        peer.regions[layer],
                        r.offset as u64,
                        l.len as u64,
                    );
                    ops.push(match direction {
                        Direction::Read => TransferOp::read(lr, lo, rr, ro, len),
                        Direction::Write => TransferOp::write(lr, lo, rr, ro, len),
                    });
                }
            }
        }
    }
    ops
}

/// The read operations that copy the KV of `tokens` prompt tokens from the peer's
/// `remote_blocks` into our `local_blocks`, one list per local rank (every layer, K and V).
///
/// # Errors
/// [`HandoffError::InvalidBlocks`] when either list does not have exactly the blocks the
/// tokens need, or names a block outside its pool.
pub fn plan_pull(
    ours: &KvPeerInfo,
    theirs: &KvPeerInfo,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    tokens: usize,
) -> Result<Vec<Vec<TransferOp>>, HandoffError> {
    let n = check_blocks(ours, theirs, local_blocks, remote_blocks, tokens)?;
    let layers = ours.ranks[0].layout.num_layers;
    Ok((0..ours.ranks.len())
        .map(|rank| {
            let slice = Slice {
                rank,
                layers: 0..layers,
                blocks: 0..n,
            };
            plan_slice(
                ours,
                theirs,
                local_blocks,
                remote_blocks,
                &slice,
                Direction::Read,
            )
        })
        .collect())
}

/// Which of a request's blocks hold only final KV once a prefill chunk covering tokens
/// `start..end` of a `prompt_len`-token prompt is computed: those a layerwise push may write
/// now. Every block is covered by exactly one chunk of a prompt's chunking (the block the
/// chunk ends inside waits for the next chunk, except at the prompt's end).
pub fn final_blocks(
    start: usize,
    end: usize,
    prompt_len: usize,
    block_size: usize,
) -> Range<usize> {
    let first = start / block_size;
    let last = if end >= prompt_len {
        prompt_len.div_ceil(block_size)
    } else {
        end / block_size
    };
    first..last.max(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::protocol::{compat_hash, RankKv};
    use pdserve_gpu::kv::{KvDtype, KvLayout};

    fn info(tp: usize, kv_heads: usize, blocks: usize, first_region: u64) -> KvPeerInfo {
        let ranks = (0..tp)
            .map(|r| RankKv {
                heads: (r * kv_heads / tp, (r + 1) * kv_heads / tp),
                layout: KvLayout {
                    num_layers: 2,
                    num_blocks: blocks,
                    block_size: 4,
                    num_kv_heads: kv_heads / tp,
                    head_dim: 8,
                    dtype: KvDtype::F32,
                },
                regions: vec![
                    first_region + 10 * r as u64,
                    first_region + 10 * r as u64 + 1,
                ],
            })
            .collect();
        KvPeerInfo {
            engine_id: format!("tp{tp}"),
            compat_key: "k".into(),
            compat_hash: compat_hash("k"),
            transfer_addr: "a".into(),
            backend: "local".into(),
            num_kv_heads: kv_heads,
            ranks,
        }
    }

    /// Every byte of every local block is written exactly once, from the same model-wide head.
    fn check_cover(ours: &KvPeerInfo, theirs: &KvPeerInfo, ops: &[TransferOp], blocks: usize) {
        let l = &ours.ranks[0].layout;
        let per_rank = l.region_bytes();
        let mut hit = vec![0u8; ours.ranks.len() * 2 * per_rank];
        for op in ops {
            let (rank, layer) = ours
                .ranks
                .iter()
                .enumerate()
                .find_map(|(r, k)| {
                    k.regions
                        .iter()
                        .position(|&g| g == op.local_region)
                        .map(|p| (r, p))
                })
                .unwrap();
            let base = (rank * 2 + layer) * per_rank;
            for b in op.local_offset..op.local_offset + op.len {
                hit[base + b as usize] += 1;
            }
            // The remote head offset maps to the same model-wide head as the local one.
            let peer = theirs
                .ranks
                .iter()
                .find(|k| k.regions.contains(&op.remote_region))
                .unwrap();
            let lh = (op.local_offset as usize % l.block_bytes()) / l.head_bytes()
                + ours.ranks[rank].heads.0;
            let rh = (op.remote_offset as usize % peer.layout.block_bytes())
                / peer.layout.head_bytes()
                + peer.heads.0;
            assert_eq!(lh, rh);
        }
        let written = hit.iter().filter(|&&h| h == 1).count();
        assert!(hit.iter().all(|&h| h <= 1), "a byte was written twice");
        assert_eq!(written, ours.ranks.len() * 2 * 2 * blocks * l.block_bytes());
    }

    #[test]
    fn pulls_cover_every_head_once_for_equal_and_different_tp() {
        for (p, d) in [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)] {
            let prefill = info(p, 4, 8, 100);
            let decode = info(d, 4, 8, 500);
            validate_peer(&decode, &prefill).unwrap();
            let ops = plan_pull(&decode, &prefill, &[3, 1, 6], &[0, 7, 2], 10).unwrap();
            assert_eq!(ops.len(), d, "one list per local rank");
            check_cover(&decode, &prefill, &ops.concat(), 3);
        }
    }

    /// A push is the pull seen from the other side: the writes every prefill rank plans, layer
    /// by layer and chunk by chunk, land on every byte of the decode blocks exactly once.
    #[test]
    fn layerwise_pushes_cover_every_destination_byte_once() {
        for (p, d) in [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)] {
            let prefill = info(p, 4, 8, 100);
            let decode = info(d, 4, 8, 500);
            validate_peer(&prefill, &decode).unwrap();
            let (local, remote) = ([5u32, 0, 2], [3u32, 1, 6]);
            assert_eq!(check_blocks(&prefill, &decode, &local, &remote, 10), Ok(3));
            let mut ops = Vec::new();
            // Chunks of 3, 4 and 3 tokens over blocks of 4: each block written once, by the
            // chunk that completes it.
            for (start, end) in [(0, 3), (3, 7), (7, 10)] {
                for rank in 0..p {
                    for layer in 0..2 {
                        let slice = Slice {
                            rank,
                            layers: layer..layer + 1,
                            blocks: final_blocks(start, end, 10, 4),
                        };
                        ops.extend(plan_slice(
                            &prefill,
                            &decode,
                            &local,
                            &remote,
                            &slice,
                            Direction::Write,
                        ));
                    }
                }
            }
            assert!(ops
                .iter()
                .all(|o| o.kind == pdserve_transport::OpKind::Write));
            // Seen from decode, the writes are reads with the roles swapped.
            let mirrored: Vec<TransferOp> = ops
                .iter()
                .map(|o| {
                    TransferOp::read(
                        o.remote_region,
                        o.remote_offset,
                        o.local_region,
                        o.local_offset,
                        o.len,
                    )
                })
                .collect();
            check_cover(&decode, &prefill, &mirrored, 3);
        }
    }

    #[test]
    fn final_blocks_partition_a_chunked_prompt() {
        assert_eq!(final_blocks(0, 10, 10, 4), 0..3);
        assert_eq!(final_blocks(0, 3, 10, 4), 0..0);
        assert_eq!(final_blocks(0, 8, 20, 4), 0..2);
        assert_eq!(final_blocks(8, 13, 20, 4), 2..3);
        assert_eq!(final_blocks(13, 20, 20, 4), 3..5);
    }

    #[test]
    fn mismatches_and_forged_blocks_are_refused() {
        let ours = info(1, 4, 8, 0);
        let mut other = info(1, 4, 8, 0);
        other.compat_key = "other model".into();
        assert!(matches!(
            validate_peer(&ours, &other),
            Err(HandoffError::Incompatible { .. })
        ));
        let mut bs = info(1, 4, 8, 0);
        bs.ranks[0].layout.block_size = 8;
        let e = validate_peer(&ours, &bs).unwrap_err();
        assert!(e.to_string().contains("blocks of 8 tokens"), "{e}");
        let mut gap = info(2, 4, 8, 0);
        gap.ranks[1].heads = (3, 4);
        assert!(matches!(
            validate_peer(&ours, &gap),
            Err(HandoffError::LayoutMismatch { .. })
        ));
        let theirs = info(1, 4, 8, 0);
        assert!(matches!(
            plan_pull(&ours, &theirs, &[0, 1], &[0, 99], 5),
            Err(HandoffError::InvalidBlocks(_))
        ));
        assert!(matches!(
            plan_pull(&ours, &theirs, &[0, 1], &[0], 5),
            Err(HandoffError::InvalidBlocks(_))
        ));
        assert!(matches!(
            plan_pull(&ours, &theirs, &[0, 1], &[0, 1, 2], 5),
            Err(HandoffError::InvalidBlocks(_))
        ));
        // A peer whose rank 1 announces a smaller pool than rank 0: refused at validation,
        // and a block id valid for rank 0 only is refused by the block check as well.
        let ours2 = info(2, 4, 8, 0);
        let mut small = info(2, 4, 8, 100);
        small.ranks[1].layout.num_blocks = 2;
        let e = validate_peer(&ours2, &small).unwrap_err();
        assert!(
            e.to_string().contains("rank 1 has a pool of 2 blocks"),
            "{e}"
        );
        assert!(matches!(
            plan_pull(&ours2, &small, &[0, 1], &[0, 5], 5),
            Err(HandoffError::InvalidBlocks(_))
        ));
    }
}
