//! Weights of the 32-element block formats (Q8_0, Q4_0, Q4_1) packed sixteen rows to a vector,
//! one byte per weight, for the default weights on AVX-512 VNNI CPUs: the layout candle's
//! `repack_x86` uses for Q8_0, run on this crate's pool.
//!
//! Per tile of 16 rows and per 32-element block: the 16 rows' f16 scales, for Q4_1 their 16
//! f16 minimums, then their quants as bytes interleaved four at a time,
//! `qs[(g · 16 + r) · 4 + j] = q[r][4g + j]`. One `vpdpbusd` of a 64-byte row of that against
//! four activation bytes broadcast to every lane adds four products to each of the sixteen
//! rows' integer sums, so a whole block's dot product of a row stays in one i32 lane (eight
//! instructions per block for sixteen rows), and the float work is done for sixteen rows at
//! once, in block order:
//!
//! - signed weights (Q8_0, and Q4_0 as its `q − 8`) are stored offset by +128 (unsigned):
//!   `(Σ (w + 128)·a − 128·Σ a) · d_w·d_a`;
//! - Q4_1 stores its unsigned `q` as it is: `Σ q·a · d_w·d_a`, and its minimum's term
//!   `m_w · s_a` (`s_a = d_a · Σ a`, the Q8_1 activation sum llama.cpp uses) in a second
//!   accumulator added at the end, as llama.cpp keeps `summs` apart.
//!
//! Every weight keeps the file's exact value: a Q4_0 or Q4_1 model runs on this kernel with
//! the weights it was trained and quantized to, not a requantized copy (until issue 28's
//! second part the default requantized them to Q8_0, which moved log-likelihoods by a median
//! 0.14 nats from llama.cpp's; docs/benchmarks.md).
//! [`QMatrix`]'s llama.cpp-exact kernels instead form eight partial lanes per block and row
//! and sum them at the end: about twice the instructions, which made a prefill about 1.7×
//! slower per thread than candle's packed kernel (`cargo bench --bench q8_kernels`).
//!
//! Every (row, token) result is the same chain of operations whatever the number of tokens,
//! the tile or the thread (integer sums are exact in any order; the float steps run block by
//! block), so results do not depend on batch composition; with chunks (row-parallel layers)
//! each chunk's sum restarts from zero, as [`matmul_chunked`](super::matmul_chunked)'s do.

use super::format::{quantize_acts, ActType, QActs, QType, QK};
use super::isa::{detect_isa, Isa};
use super::pool;

/// Rows per tile (one 512-bit vector of i32 / f32 lanes).
const TILE: usize = 16;
/// Bytes of one (tile, block) of the signed formats: 16 f16 scales and 16 × 32 quants.
const SIGNED_BLOCK_BYTES: usize = 2 * TILE + QK * TILE;
/// Bytes of one (tile, block) of Q4_1: 16 f16 scales, 16 f16 minimums, 16 × 32 quants.
const MIN_BLOCK_BYTES: usize = 4 * TILE + QK * TILE;
/// Tokens per kernel call (the activations broadcast per instruction are shared by the tile).
const MT: usize = 4;
/// Tokens per work item of a multi-token matmul.
const ITEM_TOKENS: usize = 64;

/// A Q8_0, Q4_0 or Q4_1 matrix `[rows, cols]` in the packed layout (see the module docs).
#[derive(Clone)]
pub struct PackedQ8 {
    rows: usize,
    cols: usize,
    /// Q4_1: unsigned quants and a minimum per block (otherwise signed quants, offset).
    min: bool,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedQ8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedQ8")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("min", &self.min)
            .finish()
    }
}

impl PackedQ8 {
    /// Whether this CPU runs the packed kernel (AVX-512 F and VNNI, not capped by
    /// `PDSERVE_QUANT_ISA`).
    pub fn supported() -> bool {
        detect_isa() == Isa::Avx512Vnni
    }

    /// Packs GGUF bytes of `qt` (`rows · cols / 32` blocks: Q8_0's f16 scale and 32 i8,
    /// Q4_0's scale and 16 bytes of nibbles, Q4_1's scale, minimum and nibbles). `None` when
    /// `qt` is another format, the CPU lacks the kernel, `rows` is not a multiple of 16,
    /// `cols` not of 32, or the bytes do not match the shape.
    pub fn from_gguf(qt: QType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let gguf_block = match qt {
            QType::Q8_0 | QType::Q4_0 | QType::Q4_1 => qt.block_bytes(),
            QType::Q4K | QType::Q6K => return None,
        };
        if !Self::supported()
            || rows == 0
            || !rows.is_multiple_of(TILE)
            || !cols.is_multiple_of(QK)
            || bytes.len() != rows * cols / QK * gguf_block
        {
            return None;
        }
        let min = qt == QType::Q4_1;
        let tile_block = if min {
            MIN_BLOCK_BYTES
        } else {
            SIGNED_BLOCK_BYTES
        };
        // Where a (tile, block)'s quants start: after the scales (and minimums).
        let quants_at = tile_block - QK * TILE;
        let nb = cols / QK;
        let mut data = vec![0u8; rows / TILE * nb * tile_block];
        for (t, tile) in data.chunks_mut(nb * tile_block).enumerate() {
            for (b, dst) in tile.chunks_mut(tile_block).enumerate() {
                for r in 0..TILE {
                    let src = &bytes[((t * TILE + r) * nb + b) * gguf_block..][..gguf_block];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
                    if min {
                        dst[2 * TILE + 2 * r..2 * TILE + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    for e in 0..QK {
                        // The stored byte: offset +128 for the signed formats.
                        let q = match qt {
                            QType::Q8_0 => (src[2 + e] as i8 as i16 + 128) as u8,
                            QType::Q4_0 => nibble(&src[2..], e) + 120,
                            _ => nibble(&src[4..], e),
                        };
                        let (g, j) = (e / 4, e % 4);
                        dst[quants_at + (g * TILE + r) * 4 + j] = q;
                    }
                }
            }
        }
        Some(Self {
            rows,
            cols,
            min,
            data,
        })
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
        // Q4_1's minimum term needs the activations' sums `s` (Q8_1: the same quants and
        // scales as Q8_0, plus `s`).
        let a = quantize_acts(
            x,
            self.cols,
            if self.min {
                ActType::Q8_1
            } else {
                ActType::Q8_0
            },
        );
        // Σ a per (token, block), for the +128 offset of the signed weights.
        let bsum: Vec<i32> = if self.min {
            Vec::new()
        } else {
            a.qs.chunks(QK)
                .map(|b| b.iter().map(|&q| i32::from(q)).sum())
                .collect()
        };
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
        let sums = if self.min { a.s.len() } else { bsum.len() };
        assert!(tokens.end * nb <= sums);
        let tb = self.tile_block();
        let w = self.data[tile * nb * tb..][..nb * tb].as_ptr();
        let mut t = tokens.start;
        while t < tokens.end {
            let m = (tokens.end - t).min(MT);
            let op = Ops {
                w,
                aq: a.qs[t * self.cols..].as_ptr(),
                ad: a.d[t * nb..].as_ptr(),
                bs: if self.min {
                    std::ptr::null()
                } else {
                    bsum[t * nb..].as_ptr()
                },
                sa: if self.min {
                    a.s[t * nb..].as_ptr()
                } else {
                    std::ptr::null()
                },
                nb,
            };
            let chunks = nb / chunk;
            for c in 0..chunks {
                let mut res = [[0f32; TILE]; MT];
                // SAFETY: tokens `t .. t + m` and blocks of chunk `c` are in bounds
                // (asserted above); the CPU runs the kernel (the caller's contract).
                unsafe {
                    let blocks = c * chunk..(c + 1) * chunk;
                    match (m, self.min) {
                        (1, false) => x86::tile::<1, false>(&op, blocks, &mut res),
                        (2, false) => x86::tile::<2, false>(&op, blocks, &mut res),
                        (3, false) => x86::tile::<3, false>(&op, blocks, &mut res),
                        (_, false) => x86::tile::<4, false>(&op, blocks, &mut res),
                        (1, true) => x86::tile::<1, true>(&op, blocks, &mut res),
                        (2, true) => x86::tile::<2, true>(&op, blocks, &mut res),
                        (3, true) => x86::tile::<3, true>(&op, blocks, &mut res),
                        (_, true) => x86::tile::<4, true>(&op, blocks, &mut res),
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

    /// Bytes of one (tile, block).
    fn tile_block(&self) -> usize {
        if self.min {
            MIN_BLOCK_BYTES
        } else {
            SIGNED_BLOCK_BYTES
        }
    }
}

/// Element `e` (0..32) of a Q4_0 / Q4_1 block's 16 bytes of nibbles: elements 0..16 are the
/// low nibbles, 16..32 the high ones (ggml's layout).
fn nibble(qs: &[u8], e: usize) -> u8 {
    if e < QK / 2 {
        qs[e] & 0x0f
    } else {
        qs[e - QK / 2] >> 4
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
    /// Signed weights: Σ a per (token, block) (null for Q4_1).
    bs: *const i32,
    /// Q4_1: the activations' `s = d · Σ a` per (token, block) (null otherwise).
    sa: *const f32,
    nb: usize,
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Ops, MIN_BLOCK_BYTES, QK, SIGNED_BLOCK_BYTES, TILE};
    use std::arch::x86_64::*;

    /// Tokens `0..M` of `o` against its tile over `blocks`: `out[m][r]`. `MIN`: Q4_1's layout
    /// (unsigned quants, a minimum per block), otherwise the signed formats' (+128 offset).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `o`'s pointers hold `M` tokens and the blocks, and
    /// `o.sa` (`MIN`) or `o.bs` (otherwise) is not null.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni")]
    pub(super) unsafe fn tile<const M: usize, const MIN: bool>(
        o: &Ops,
        blocks: std::ops::Range<usize>,
        out: &mut [[f32; TILE]; super::MT],
    ) {
        let (tile_block, quants_at) = if MIN {
            (MIN_BLOCK_BYTES, 4 * TILE)
        } else {
            (SIGNED_BLOCK_BYTES, 2 * TILE)
        };
        let mut acc = [_mm512_setzero_ps(); M];
        // Q4_1: Σ m_w · s_a, apart from the scaled integer sums (llama.cpp's `summs`).
        let mut macc = [_mm512_setzero_ps(); M];
        // SAFETY (all reads): in bounds by the function's contract.
        unsafe {
            for b in blocks {
                let tb = o.w.add(b * tile_block);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tb as *const __m256i));
                let qb = tb.add(quants_at);
                // Two independent integer chains per token (even and odd groups of four).
                let mut even = [_mm512_setzero_si512(); M];
                let mut odd = [_mm512_setzero_si512(); M];
                for g in (0..QK / 4).step_by(2) {
                    let w0 = _mm512_loadu_si512(qb.add(g * TILE * 4) as *const _);
                    let w1 = _mm512_loadu_si512(qb.add((g + 1) * TILE * 4) as *const _);
                    for m in 0..M {
                        let ap = o.aq.add(m * o.nb * QK + b * QK + g * 4);
                        let a0 = _mm512_set1_epi32(std::ptr::read_unaligned(ap as *const i32));
                        let a1 =
                            _mm512_set1_epi32(std::ptr::read_unaligned(ap.add(4) as *const i32));
                        even[m] = _mm512_dpbusd_epi32(even[m], w0, a0);
                        odd[m] = _mm512_dpbusd_epi32(odd[m], w1, a1);
                    }
                }
                let mw = if MIN {
                    _mm512_cvtph_ps(_mm256_loadu_si256(tb.add(2 * TILE) as *const __m256i))
                } else {
                    _mm512_setzero_ps()
                };
                for m in 0..M {
                    let both = _mm512_add_epi32(even[m], odd[m]);
                    let sum = if MIN {
                        both
                    } else {
                        let corr = _mm512_set1_epi32(128 * *o.bs.add(m * o.nb + b));
                        _mm512_sub_epi32(both, corr)
                    };
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*o.ad.add(m * o.nb + b)));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dd, acc[m]);
                    if MIN {
                        let sa = _mm512_set1_ps(*o.sa.add(m * o.nb + b));
                        macc[m] = _mm512_fmadd_ps(mw, sa, macc[m]);
                    }
                }
            }
            for m in 0..M {
                let v = if MIN {
                    _mm512_add_ps(acc[m], macc[m])
                } else {
                    acc[m]
                };
                _mm512_storeu_ps(out[m].as_mut_ptr(), v);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Ops, TILE};

    /// Never called: [`PackedQ8::supported`] is false off x86-64.
    pub(super) unsafe fn tile<const M: usize, const MIN: bool>(
        _: &Ops,
        _: std::ops::Range<usize>,
        _: &mut [[f32; TILE]; super::MT],
    ) {
        unreachable!("packed weights exist only on x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, QMatrix, QType};
    use super::*;

    #[test]
    fn packed_matmul_is_batch_invariant_and_matches_the_exact_kernels_closely() {
        for qt in [QType::Q8_0, QType::Q4_0, QType::Q4_1] {
            check_format(qt);
        }
    }

    /// The packed matmul of `qt` weights: the exact kernels' value up to the float summation
    /// order (same quantized operands), the same bits whatever the token grouping, and chunk
    /// partials that add up to the row.
    fn check_format(qt: QType) {
        let (rows, cols) = (48, 192);
        let bytes = super::super::format::tests::gguf_bytes(qt, rows, cols, 7);
        let Some(p) = PackedQ8::from_gguf(qt, rows, cols, &bytes) else {
            eprintln!("no AVX-512 VNNI here: the packed kernel is not used");
            return;
        };
        let q = QMatrix::from_gguf(qt, rows, cols, &bytes).unwrap();
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
                let (got, want) = (all[t * rows + r], exact[t * rows + r]);
                assert!(
                    (got - want).abs() <= 1e-5 * mag.max(1.0),
                    "{qt:?} row {r} token {t}: {got} vs {want}"
                );
            }
        }
        // One token at a time, and any other grouping, gives the same bits.
        for t in [0, 3, 64, 69] {
            let one = p.matmul(&x[t * cols..(t + 1) * cols], 1);
            assert_eq!(
                one,
                all[t * rows..(t + 1) * rows].to_vec(),
                "{qt:?} token {t}"
            );
        }
        let five = p.matmul(&x[..5 * cols], 5);
        assert_eq!(five, all[..5 * rows].to_vec(), "{qt:?}");
        // Chunk partials add up to the whole row.
        let parts = p.matmul_chunked(&x, 70, 2);
        for (i, v) in all.iter().enumerate() {
            let s = parts[3 * i] + parts[3 * i + 1] + parts[3 * i + 2];
            assert!((s - v).abs() <= 1e-4 * v.abs().max(1.0), "{qt:?} {i}");
        }
        // A shape the kernel does not take is refused.
        let short = 40 * cols / QK * qt.block_bytes();
        assert!(PackedQ8::from_gguf(qt, 40, cols, &bytes[..short]).is_none());
    }

    #[test]
    fn k_quants_are_not_packed() {
        let bytes = super::super::format::tests::gguf_bytes(QType::Q4K, 16, 256, 3);
        assert!(PackedQ8::from_gguf(QType::Q4K, 16, 256, &bytes).is_none());
    }
}
