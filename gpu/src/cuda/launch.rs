//! Launch geometry of every kernel: pure functions of the problem size, so the arithmetic is
//! unit-tested without a GPU. The kernels' own constants (`PD_ATTN_WARPS`, ...) are checked
//! against the ones here by parsing the sources.

use crate::device::DeviceError;

/// Threads in a warp.
pub const WARP: u32 = 32;
/// Most threads in one block on every supported GPU.
pub const MAX_BLOCK_THREADS: u32 = 1024;
/// Threads per block of row kernels (RMSNorm, embedding, RoPE, K/V writes).
pub const ROW_THREADS: u32 = 256;
/// Threads per block of grid-stride element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Most blocks of a grid-stride kernel (enough to fill any GPU; the loop covers the rest).
pub const ELEMENTWISE_MAX_BLOCKS: u32 = 65_535;
/// Warps per attention block (`PD_ATTN_WARPS` in `attention.cu`).
pub const ATTN_WARPS: u32 = 16;
/// Largest head size the attention kernel holds (`PD_ATTN_MAX_HEAD_DIM`).
pub const ATTN_MAX_HEAD_DIM: usize = 256;
/// Largest `gridDim.y` (and `z`).
pub const MAX_GRID_Y: usize = 65_535;
/// Largest `gridDim.x`.
pub const MAX_GRID_X: usize = i32::MAX as usize;

/// A launch: grid and block dimensions and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub shared_bytes: u32,
}

impl Launch {
    /// Total threads launched.
    pub fn threads(&self) -> u64 {
        let g = self.grid.0 as u64 * self.grid.1 as u64 * self.grid.2 as u64;
        g * self.block.0 as u64 * self.block.1 as u64 * self.block.2 as u64
    }
}

fn too_big(what: &str, n: usize, max: usize) -> DeviceError {
    DeviceError::Unsupported(format!("{what} {n} exceeds the CUDA grid limit {max}"))
}

/// Threads for one block working on a row of `width` elements: a whole number of warps,
/// at least one, at most `cap`.
pub fn row_threads(width: usize, cap: u32) -> u32 {
    let cap = cap.clamp(WARP, MAX_BLOCK_THREADS) / WARP * WARP;
    let want = width.div_ceil(WARP as usize).max(1) * WARP as usize;
    (want.min(cap as usize)) as u32
}

/// One block per row (RMSNorm, embedding, RoPE, K/V writes, argmax).
///
/// # Errors
/// [`DeviceError::Unsupported`] when `rows` exceeds the grid limit.
pub fn per_row(rows: usize, width: usize, cap: u32) -> Result<Launch, DeviceError> {
    if rows > MAX_GRID_X {
        return Err(too_big("rows", rows, MAX_GRID_X));
    }
    Ok(Launch {
        grid: (rows.max(1) as u32, 1, 1),
        block: (row_threads(width, cap), 1, 1),
        shared_bytes: 0,
    })
}

/// A grid-stride loop over `n` elements.
pub fn elementwise(n: usize) -> Launch {
    let blocks = n
        .div_ceil(ELEMENTWISE_THREADS as usize)
        .clamp(1, ELEMENTWISE_MAX_BLOCKS as usize);
    Launch {
        grid: (blocks as u32, 1, 1),
        block: (ELEMENTWISE_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// Paged attention: one block of [`ATTN_WARPS`] warps per (token, query head).
///
/// # Errors
/// [`DeviceError::Unsupported`] for a head larger than [`ATTN_MAX_HEAD_DIM`] or more query
/// heads than the grid's y limit.
pub fn attention(tokens: usize, q_heads: usize, head_dim: usize) -> Result<Launch, DeviceError> {
    if head_dim > ATTN_MAX_HEAD_DIM {
        return Err(DeviceError::Unsupported(format!(
            "head_dim {head_dim} (the attention kernel holds at most {ATTN_MAX_HEAD_DIM})"
        )));
    }
    if q_heads > MAX_GRID_Y {
        return Err(too_big("query heads", q_heads, MAX_GRID_Y));
    }
    if tokens > MAX_GRID_X {
        return Err(too_big("tokens", tokens, MAX_GRID_X));
    }
    Ok(Launch {
        grid: (tokens.max(1) as u32, q_heads.max(1) as u32, 1),
        block: (ATTN_WARPS * WARP, 1, 1),
        shared_bytes: 0,
    })
}

/// The ranges of keys each attention warp walks for a query at position `pos`: warp `w` takes
/// keys `w, w + ATTN_WARPS, ...` up to `pos` (what `attention.cu` does), so together they
/// cover `0..=pos` exactly once.
pub fn attention_keys_of_warp(pos: usize, warp: u32) -> impl Iterator<Item = usize> {
    (warp as usize..=pos).step_by(ATTN_WARPS as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::{define_value, source_of};

    #[test]
    fn row_threads_are_whole_warps_within_the_cap() {
        assert_eq!(row_threads(0, 256), 32);
        assert_eq!(row_threads(1, 256), 32);
        assert_eq!(row_threads(33, 256), 64);
        assert_eq!(row_threads(576, 256), 256);
        assert_eq!(row_threads(49_152, 1024), 1024);
        assert_eq!(row_threads(100, 50), 32);
        assert_eq!(row_threads(5000, 4096), 1024);
        for w in 0..3000 {
            let t = row_threads(w, ROW_THREADS);
            assert!(t.is_multiple_of(WARP) && (WARP..=ROW_THREADS).contains(&t));
        }
    }

    #[test]
    fn elementwise_covers_every_element_once() {
        for n in [0usize, 1, 255, 256, 257, 1 << 20, 1 << 26] {
            let l = elementwise(n);
            assert!(l.grid.0 >= 1 && l.grid.0 <= ELEMENTWISE_MAX_BLOCKS);
            // The grid-stride loop `i += gridDim * blockDim` visits each i < n exactly once
            // whatever the grid; with no cap hit, one pass is enough.
            if n.div_ceil(256) <= ELEMENTWISE_MAX_BLOCKS as usize {
                assert!(l.threads() >= n as u64);
                assert!(l.threads() < n as u64 + 256 || n == 0);
            }
        }
    }

    #[test]
    fn attention_grid_and_limits() {
        let l = attention(37, 9, 64).unwrap();
        assert_eq!(l.grid, (37, 9, 1));
        assert_eq!(l.block, (512, 1, 1));
        assert_eq!(attention(1, 1, 257).unwrap_err().kind(), "cuda_unsupported");
        assert!(attention(1, 70_000, 64).is_err());
    }

    #[test]
    fn attention_warps_cover_the_causal_context_exactly_once() {
        for pos in [0usize, 1, 2, 3, 4, 5, 63, 64, 1000] {
            let mut seen = vec![0u8; pos + 1];
            for w in 0..ATTN_WARPS {
                for k in attention_keys_of_warp(pos, w) {
                    seen[k] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "pos {pos}");
        }
    }

    #[test]
    fn kernel_constants_match_the_sources() {
        let attn = source_of("paged_attention_f32_f32").unwrap().body;
        assert_eq!(define_value(attn, "PD_ATTN_WARPS"), Some(ATTN_WARPS as i64));
        let per_lane = define_value(attn, "PD_ATTN_MAX_DIMS_PER_LANE").unwrap();
        assert_eq!(per_lane as usize * WARP as usize, ATTN_MAX_HEAD_DIM);
    }
}
