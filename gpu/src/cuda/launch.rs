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
/// Keys per attention part, counted from position 0 (`PD_ATTN_PART`): a row's context is
/// attended part by part and the parts folded in order, whichever launch runs it.
pub const ATTN_PART: usize = 256;
/// A step with fewer (token, query head) rows than this, over more than one part, is split:
/// one block per part, so a decode over a long context fills the GPU (an H100 has 132
/// streaming multiprocessors; one block per head would use a handful of them).
pub const ATTN_SPLIT_BELOW_ROWS: usize = 1024;
/// Most `f32`s the split launch's partial results may take (256 MiB); beyond it the step
/// runs whole.
pub const ATTN_MAX_PARTIAL_FLOATS: usize = 64 << 20;
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

/// How a step's attention is launched (see `attention.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionLaunch {
    /// The `paged_attention_*` launch: grid (tokens, query heads, 1) whole, or (tokens, query
    /// heads, [`Self::parts`]) split.
    pub main: Launch,
    /// The `attention_combine_*` launch that folds a split step's parts; `None` when whole.
    pub combine: Option<Launch>,
    /// Parts of the longest row's context ([`ATTN_PART`] keys each).
    pub parts: usize,
    /// `f32`s of partial results the split launch writes (0 when whole): per (token, head,
    /// part) its max, its sum and `head_dim` outputs.
    pub partial_floats: usize,
}

/// Paged attention of `tokens` query tokens whose longest context is `max_ctx` keys: blocks
/// of [`ATTN_WARPS`] warps, one per (token, query head) walking its parts in order, or — for
/// few rows over more than one part — one per (token, query head, part) and a combine launch.
/// Both compute the same bits for every row.
///
/// # Errors
/// [`DeviceError::Unsupported`] for a head larger than [`ATTN_MAX_HEAD_DIM`] or more query
/// heads than the grid's y limit.
pub fn attention(
    tokens: usize,
    q_heads: usize,
    head_dim: usize,
    max_ctx: usize,
) -> Result<AttentionLaunch, DeviceError> {
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
    let (tokens, q_heads) = (tokens.max(1), q_heads.max(1));
    let parts = max_ctx.div_ceil(ATTN_PART).max(1);
    let rows = tokens * q_heads;
    let partial_floats = rows.saturating_mul(parts).saturating_mul(head_dim + 2);
    let split = parts > 1
        && rows < ATTN_SPLIT_BELOW_ROWS
        && parts <= MAX_GRID_Y
        && partial_floats <= ATTN_MAX_PARTIAL_FLOATS;
    let grid = (tokens as u32, q_heads as u32);
    let split_launch = AttentionLaunch {
        main: Launch {
            grid: (grid.0, grid.1, parts as u32),
            block: (ATTN_WARPS * WARP, 1, 1),
            shared_bytes: 0,
        },
        combine: Some(Launch {
            grid: (grid.0, grid.1, 1),
            block: (row_threads(head_dim, ROW_THREADS), 1, 1),
            shared_bytes: 0,
        }),
        parts,
        partial_floats,
    };
    Ok(if split {
        split_launch
    } else {
        split_launch.whole()
    })
}

impl AttentionLaunch {
    /// The same step launched whole: one block per (token, query head) walking its parts in
    /// order, no partial results, no combine.
    pub fn whole(self) -> Self {
        Self {
            main: Launch {
                grid: (self.main.grid.0, self.main.grid.1, 1),
                ..self.main
            },
            combine: None,
            partial_floats: 0,
            ..self
        }
    }
}

/// The keys attention warp `warp` walks in part `part` for a query at position `pos`: keys
/// `part * ATTN_PART + warp`, then every [`ATTN_WARPS`]-th, up to the part's end or `pos`
/// (what `attention.cu` does), so the parts' warps together cover `0..=pos` exactly once.
pub fn attention_keys_of_warp(pos: usize, part: usize, warp: u32) -> impl Iterator<Item = usize> {
    let begin = part * ATTN_PART;
    let end = (begin + ATTN_PART).min(pos + 1);
    (begin + warp as usize..end).step_by(ATTN_WARPS as usize)
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
        // Short contexts: one part, whole.
        let l = attention(37, 9, 64, 200).unwrap();
        assert_eq!(l.main.grid, (37, 9, 1));
        assert_eq!(l.main.block, (512, 1, 1));
        assert_eq!((l.combine, l.partial_floats, l.parts), (None, 0, 1));
        assert_eq!(
            attention(1, 1, 257, 1).unwrap_err().kind(),
            "cuda_unsupported"
        );
        assert!(attention(1, 70_000, 64, 1).is_err());
    }

    #[test]
    fn few_rows_over_long_contexts_split_into_parts() {
        // A batch-1 decode at 2048 keys: 8 parts of 256, one block each, and a combine.
        let l = attention(1, 9, 64, 2048).unwrap();
        assert_eq!(l.parts, 8);
        assert_eq!(l.main.grid, (1, 9, 8));
        assert_eq!(l.partial_floats, 9 * 8 * 66);
        let c = l.combine.unwrap();
        assert_eq!(c.grid, (1, 9, 1));
        assert!(c.block.0 >= 64 && c.block.0.is_multiple_of(WARP));
        // 257 keys are two parts.
        assert_eq!(attention(1, 9, 64, 257).unwrap().parts, 2);
        assert!(attention(1, 9, 64, 257).unwrap().combine.is_some());
        // A prefill chunk has rows enough to fill the GPU: whole, whatever its context.
        let p = attention(512, 9, 64, 4096).unwrap();
        assert_eq!((p.main.grid, p.combine, p.parts), ((512, 9, 1), None, 16));
        // Partial results are bounded: a context that would need more runs whole.
        let huge = attention(100, 9, 256, 1 << 24).unwrap();
        assert!(huge.combine.is_none());
        assert_eq!(huge.partial_floats, 0);
    }

    #[test]
    fn attention_parts_and_warps_cover_the_causal_context_exactly_once() {
        for pos in [0usize, 1, 2, 3, 4, 5, 63, 64, 255, 256, 257, 1000, 4095] {
            let mut seen = vec![0u8; pos + 1];
            let parts = attention(1, 1, 64, pos + 1).unwrap().parts;
            assert_eq!(parts, (pos + 1).div_ceil(ATTN_PART));
            for part in 0..parts {
                for w in 0..ATTN_WARPS {
                    for k in attention_keys_of_warp(pos, part, w) {
                        seen[k] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "pos {pos}");
        }
    }

    #[test]
    fn kernel_constants_match_the_sources() {
        let attn = source_of("paged_attention_f32_f32").unwrap().body;
        assert_eq!(define_value(attn, "PD_ATTN_WARPS"), Some(ATTN_WARPS as i64));
        assert_eq!(define_value(attn, "PD_ATTN_PART"), Some(ATTN_PART as i64));
        let per_lane = define_value(attn, "PD_ATTN_MAX_DIMS_PER_LANE").unwrap();
        assert_eq!(per_lane as usize * WARP as usize, ATTN_MAX_HEAD_DIM);
    }
}
