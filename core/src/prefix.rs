//! Prefix keys of the KV cache: the chained hash of each full block of a prompt.
//!
//! A block's [`BlockHash`] is FNV-1a 64 over its parent block's hash, the instance's salt
//! ([`cache_salt`] of its compatibility key: model, KV dtype, layout, block size) and the
//! block's token ids, so equal hashes mean equal prefixes on instances whose KV is compatible,
//! and instances with different KV layouts never match. A leaf: the block pool
//! ([`crate::block_manager`]), the KV events ([`crate::kv_events`]), the KV tiers and the
//! proxy's index all key blocks by these hashes.

/// The chained hash of one full block of tokens (see the module docs).
pub type BlockHash = u64;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a 64 folded over `words`, starting from `seed`.
fn fnv(seed: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = seed;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The salt of an instance's block hashes: FNV-1a 64 of its compatibility key (stable across
/// builds and processes).
pub fn cache_salt(compat_key: &str) -> u64 {
    fnv(FNV_OFFSET, compat_key.bytes().map(u64::from))
}

/// The chained hashes of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(salt: u64, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::new();
    extend_hashes(salt, &mut out, tokens, block_size);
    out
}

/// Appends to `hashes` (those of the first `hashes.len()` blocks of `tokens`) the hashes of
/// the following full blocks of `tokens`.
pub fn extend_hashes(salt: u64, hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    let bs = block_size.max(1);
    let mut parent = hashes.last().copied().unwrap_or(salt);
    for block in tokens.chunks_exact(bs).skip(hashes.len()) {
        let words = [parent, salt]
            .into_iter()
            .chain(block.iter().map(|&t| u64::from(t)));
        parent = fnv(FNV_OFFSET, words);
        hashes.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn toks(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn hashes_chain_over_the_prefix_and_the_salt() {
        let t = toks(10, 1);
        let h = block_hashes(7, &t, BS);
        assert_eq!(h.len(), 2, "the partial third block has no hash");
        let mut other = t.clone();
        other[0] += 1;
        let h2 = block_hashes(7, &other, BS);
        assert_ne!(
            h[1], h2[1],
            "a different first block changes every later hash"
        );
        assert_ne!(
            block_hashes(8, &t, BS)[0],
            h[0],
            "another layout never matches"
        );
        assert_eq!(block_hashes(7, &t[..8], BS), h, "stable");
    }

    #[test]
    fn extending_matches_hashing_at_once() {
        let t = toks(13, 2);
        let mut h = block_hashes(5, &t[..6], BS);
        extend_hashes(5, &mut h, &t, BS);
        assert_eq!(h, block_hashes(5, &t, BS));
    }
}
