//! Q8_0 weights packed sixteen rows to a vector, for the default (requantized) weights on
//! AVX-512 VNNI CPUs: the layout candle's `repack_x86` uses, run on this crate's pool.
//!
//! Per tile of 16 rows and per 32-element block: the 16 rows' f16 scales, then their quants
//! offset by +128 (unsigned) and interleaved four bytes at a time,
//! `qs[(g · 16 + r) · 4 + j] = w[r][4g + j] + 128`. One `vpdpbusd` of a 64-byte row of that
//! against four activation bytes broadcast to every lane adds four products to each of the
//! sixteen rows' integer sums, so a whole block's dot product of a row stays in one i32 lane
//! (eight instructions per block for sixteen rows), and the float work, `(Σ (w + 128)·a −
//! 128·Σ a) · d_w·d_a` fused-multiply-added in block order, is done for sixteen rows at once.
//! [`QMatrix`]'s llama.cpp-exact kernels instead form eight partial lanes per block and row
//! and sum them at the end: about twice the instructions, which made a prefill about 1.7×
//! slower per thread than candle's packed kernel (`cargo bench --bench q8_kernels`).
//!
//! Every (row, token) result is the same chain of operations whatever the number of tokens,
//! the tile or the thread (integer sums are exact in any order; the float steps run block by
//! block), so results do not depend on batch composition; with chunks (row-parallel layers)
//! each chunk's sum restarts from zero, as [`matmul_chunked`](super::matmul_chunked)'s do.

use super::format::{quantize_acts, ActType, QActs, QK};
use super::isa::{detect_isa, Isa};
use super::pool;

/// Rows per tile (one 512-bit vector of i32 / f32 lanes).
const TILE: usize = 16;
/// Bytes of one (tile, block): 16 f16 scales and 16 × 32 quants.
const TILE_BLOCK_BYTES: usize = 2 * TILE + QK * TILE;
/// Tokens per kernel call (the activations broadcast per instruction are shared by the tile).
const MT: usize = 4;
/// Tokens per work item of a multi-token matmul.
const ITEM_TOKENS: usize = 64;

/// A Q8_0 matrix `[rows, cols]` in the packed layout (see the module docs).
#[derive(Clone)]
pub struct PackedQ8 {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedQ8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedQ8")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl PackedQ8 {
    /// Whether this CPU runs the packed kernel (AVX-512 F and VNNI, not capped by
    /// `PDSERVE_QUANT_ISA`).
    pub fn supported() -> bool {
        detect_isa() == Isa::Avx512Vnni
    }

    /// Packs GGUF Q8_0 bytes (`rows · cols / 32` blocks of an f16 scale and 32 i8). `None`
    /// when the CPU lacks the kernel, `rows` is not a multiple of 16, `cols` not of 32, or
    /// the bytes do not match the shape.
    pub fn from_gguf(rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        const GGUF_BLOCK: usize = 2 + QK;
        if !Self::supported()
            || rows == 0
            || !rows.is_multiple_of(TILE)
            || !cols.is_multiple_of(QK)
            || bytes.len() != rows * cols / QK * GGUF_BLOCK
        {
            return None;
        }
        let nb = cols / QK;
        let mut data = vec![0u8; rows / TILE * nb * TILE_BLOCK_BYTES];
        for (t, tile) in data.chunks_mut(nb * TILE_BLOCK_BYTES).enumerate() {
            for (b, dst) in tile.chunks_mut(TILE_BLOCK_BYTES).enumerate() {
                for r in 0..TILE {
                    let src = &bytes[((t * TILE + r) * nb + b) * GGUF_BLOCK..][..GGUF_BLOCK];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                    for (e, &q) in src[2..].iter().enumerate() {
                        let (g, j) = (e / 4, e % 4);
                        dst[2 * TILE + (g * TILE + r) * 4 + j] = (q as i8 as i16 + 128) as u8;
                    }
                }
            }
        }
        Some(Self { rows, cols, data })
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Bytes in memory.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// `x` is `[tokens, cols]`; returns `[tokens, rows]`.
    ///
    /// # Panics
    /// When `x.len()` is not `tokens · cols`.
    pub fn matmul(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        self.matmul_chunked(x, tokens, self.blocks())
    }

    /// As [`matmul`](Self::matmul), each row's blocks summed in chunks of `chunk` blocks:
    /// returns `[tokens, rows, blocks / chunk]` partial sums.
    ///
    /// # Panics
    /// When `x.len()` is not `tokens · cols` or `chunk` does not divide the blocks.
    pub fn matmul_chunked(&self, x: &[f32], tokens: usize, chunk: usize) -> Vec<f32> {
        let nb = self.blocks();
        assert_eq!(x.len(), tokens * self.cols);
        assert!(chunk > 0 && nb.is_multiple_of(chunk));
        let chunks = nb / chunk;
        let a = quantize_acts(x, self.cols, ActType::Q8_0);
        // Σ a per (token, block), for the +128 offset of the weights.
        let bsum: Vec<i32> =
            a.qs.chunks(QK)
                .map(|b| b.iter().map(|&q| i32::from(q)).sum())
                .collect();
        let n = tokens * self.rows * chunks;
        let mut out = Vec::<f32>::with_capacity(n);
        let dst = Dst(out.as_mut_ptr());
        let tiles = self.rows / TILE;
        let threads = pool::global().threads();
        // Decode: runs of tiles, about a quarter of the matrix per item at two threads (as
        // `matmul`'s GEMV items); otherwise one tile × up to `ITEM_TOKENS` tokens per item.
        let (tiles_per_item, token_items) = if tokens == 1 {
            (tiles.div_ceil(2 * threads.max(1)).clamp(1, 16), 1)
        } else {
            (1, tokens.div_ceil(ITEM_TOKENS))
        };
        let tile_items = tiles.div_ceil(tiles_per_item);
        let item = |i: usize| {
            let (tc, ti) = (i / tile_items, i % tile_items);
            let t0 = tc * ITEM_TOKENS;
            let t1 = if tokens == 1 {
                1
            } else {
                (t0 + ITEM_TOKENS).min(tokens)
            };
            for tile in ti * tiles_per_item..((ti + 1) * tiles_per_item).min(tiles) {
                // SAFETY: the CPU runs the kernel (checked when packing); this item writes
                // the outputs of its tiles' rows for its tokens only.
                unsafe { self.run_tile(tile, &a, &bsum, t0..t1, chunk, &dst) };
            }
        };
        pool::global().run(tile_items * token_items, &item);
        // SAFETY: the items cover every (token, tile, chunk) once, each writing all its
        // values (a panicking item panics in `run`, before this).
        unsafe { out.set_len(n) };
        out
    }

    /// Tile `tile`'s rows for `tokens`, in groups of [`MT`].
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `dst` holds `[tokens, rows, chunks]` and no one else
    /// writes this tile's rows of these tokens.
    unsafe fn run_tile(
        &self,
        tile: usize,
        a: &QActs,
        bsum: &[i32],
        tokens: std::ops::Range<usize>,
        chunk: usize,
        dst: &Dst,
    ) {
        let nb = self.blocks();
        assert!(tokens.end * nb <= a.d.len() && a.qs.len() >= tokens.end * self.cols);
        let w = self.data[tile * nb * TILE_BLOCK_BYTES..][..nb * TILE_BLOCK_BYTES].as_ptr();
        let mut t = tokens.start;
        while t < tokens.end {
            let m = (tokens.end - t).min(MT);
            let op = Ops {
                w,
                aq: a.qs[t * self.cols..].as_ptr(),
                ad: a.d[t * nb..].as_ptr(),
                bs: bsum[t * nb..].as_ptr(),
                nb,
            };
            let chunks = nb / chunk;
            for c in 0..chunks {
                let mut res = [[0f32; TILE]; MT];
                // SAFETY: tokens `t .. t + m` and blocks of chunk `c` are in bounds
                // (asserted above); the CPU runs the kernel (the caller's contract).
                unsafe {
                    match m {
                        1 => x86::tile::<1>(&op, c * chunk..(c + 1) * chunk, &mut res),
                        2 => x86::tile::<2>(&op, c * chunk..(c + 1) * chunk, &mut res),
                        3 => x86::tile::<3>(&op, c * chunk..(c + 1) * chunk, &mut res),
                        _ => x86::tile::<4>(&op, c * chunk..(c + 1) * chunk, &mut res),
                    }
                }
                for (k, row) in res[..m].iter().enumerate() {
                    for (r, &v) in row.iter().enumerate() {
                        let at = ((t + k) * self.rows + tile * TILE + r) * chunks + c;
                        // SAFETY: inside `dst` and this item's (the caller's contract).
                        unsafe { dst.0.add(at).write(v) };
                    }
                }
            }
            t += m;
        }
    }
}

/// The output, written by the items at disjoint places.
struct Dst(*mut f32);
// SAFETY: items write disjoint (token, row, chunk) entries; nothing reads while they run.
unsafe impl Sync for Dst {}

/// One kernel call's operands: a tile's blocks, and tokens' quants, scales and sums from the
/// first token of the call.
struct Ops {
    w: *const u8,
    aq: *const i8,
    ad: *const f32,
    bs: *const i32,
    nb: usize,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Ops, QK, TILE, TILE_BLOCK_BYTES};
    use std::arch::x86_64::*;

    /// Tokens `0..M` of `o` against its tile over `blocks`: `out[m][r]`.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `o`'s pointers hold `M` tokens and the blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni")]
    pub(super) unsafe fn tile<const M: usize>(
        o: &Ops,
        blocks: std::ops::Range<usize>,
        out: &mut [[f32; TILE]; super::MT],
    ) {
        let mut acc = [_mm512_setzero_ps(); M];
        // SAFETY (all reads): in bounds by the function's contract.
        unsafe {
            for b in blocks {
                let tb = o.w.add(b * TILE_BLOCK_BYTES);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tb as *const __m256i));
                // Two independent integer chains per token (even and odd groups of four).
                let mut even = [_mm512_setzero_si512(); M];
                let mut odd = [_mm512_setzero_si512(); M];
                for g in (0..QK / 4).step_by(2) {
                    let w0 = _mm512_loadu_si512(tb.add(2 * TILE + g * TILE * 4) as *const _);
                    let w1 = _mm512_loadu_si512(tb.add(2 * TILE + (g + 1) * TILE * 4) as *const _);
                    for m in 0..M {
                        let ap = o.aq.add(m * o.nb * QK + b * QK + g * 4);
                        let a0 = _mm512_set1_epi32(std::ptr::read_unaligned(ap as *const i32));
                        let a1 =
                            _mm512_set1_epi32(std::ptr::read_unaligned(ap.add(4) as *const i32));
                        even[m] = _mm512_dpbusd_epi32(even[m], w0, a0);
                        odd[m] = _mm512_dpbusd_epi32(odd[m], w1, a1);
                    }
                }
                for m in 0..M {
                    let corr = _mm512_set1_epi32(128 * *o.bs.add(m * o.nb + b));
                    let sum = _mm512_sub_epi32(_mm512_add_epi32(even[m], odd[m]), corr);
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*o.ad.add(m * o.nb + b)));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dd, acc[m]);
                }
            }
            for m in 0..M {
                _mm512_storeu_ps(out[m].as_mut_ptr(), acc[m]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Ops, TILE};

    /// Never called: [`PackedQ8::supported`] is false off x86-64.
    pub(super) unsafe fn tile<const M: usize>(
        _: &Ops,
        _: std::ops::Range<usize>,
        _: &mut [[f32; TILE]; super::MT],
    ) {
        unreachable!("packed Q8_0 weights exist only on x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, QMatrix, QType};
    use super::*;

    #[test]
    fn packed_matmul_is_batch_invariant_and_matches_the_exact_kernels_closely() {
        let (rows, cols) = (48, 192);
        let bytes = super::super::format::tests::gguf_bytes(QType::Q8_0, rows, cols, 7);
        let Some(p) = PackedQ8::from_gguf(rows, cols, &bytes) else {
            eprintln!("no AVX-512 VNNI here: the packed kernel is not used");
            return;
        };
        let q = QMatrix::from_gguf(QType::Q8_0, rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..70 * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
            .collect();
        let all = p.matmul(&x, 70);
        let exact = super::super::matmul(&q, &x, 70);
        let mut wr = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&q, r, &mut wr);
            for t in 0..70 {
                let xr = &x[t * cols..(t + 1) * cols];
                let mag: f32 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                // Same quantized operands; only the float summation order differs.
                let (got, want) = (all[t * rows + r], exact[t * rows + r]);
                assert!((got - want).abs() <= 1e-5 * mag.max(1.0), "{r} {t}");
            }
        }
        // One token at a time, and any other grouping, gives the same bits.
        for t in [0, 3, 64, 69] {
            let one = p.matmul(&x[t * cols..(t + 1) * cols], 1);
            assert_eq!(one, all[t * rows..(t + 1) * rows].to_vec(), "token {t}");
        }
        let five = p.matmul(&x[..5 * cols], 5);
        assert_eq!(five, all[..5 * rows].to_vec());
        // Chunk partials add up to the whole row.
        let parts = p.matmul_chunked(&x, 70, 2);
        for (i, v) in all.iter().enumerate() {
            let s = parts[3 * i] + parts[3 * i + 1] + parts[3 * i + 2];
            assert!((s - v).abs() <= 1e-4 * v.abs().max(1.0), "{i}");
        }
        // A shape the kernel does not take is refused.
        assert!(PackedQ8::from_gguf(40, cols, &bytes[..40 * cols / 32 * 34]).is_none());
    }
}
