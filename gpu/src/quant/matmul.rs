//! Matmuls of a quantized weight matrix with f32 activation rows, split over the compute
//! pool by tiles of weight rows. Every (weight row, token) result is computed by the same
//! kernel call sequence whatever the tile, the thread or the number of tokens, so results do
//! not depend on batch composition.

use super::format::{quantize_acts, QMatrix};
use super::kernels::{detect_isa, dot_chunks, MAX_TOKENS};
use super::pool;

/// Weight rows per work item: small enough for the two threads to balance a 576-row matrix,
/// large enough to amortise claiming.
const ROW_TILE: usize = 16;

struct OutPtr(*mut f32);
// SAFETY: items write disjoint index sets of the output (see `matmul_chunked`).
unsafe impl Sync for OutPtr {}

/// `x` is `[tokens, cols]` row-major; returns `[tokens, rows]`: each value one llama.cpp
/// `vec_dot` over the whole row.
///
/// # Panics
/// When `x.len()` is not `tokens · w.cols()`.
pub fn matmul(w: &QMatrix, x: &[f32], tokens: usize) -> Vec<f32> {
    matmul_chunked(w, x, tokens, w.blocks())
}

/// As [`matmul`], with each row's blocks reduced in chunks of `chunk` blocks: returns
/// `[tokens, rows, blocks / chunk]` partial sums (row-parallel layers add them in a fixed
/// order, so the result does not depend on how the columns were sharded).
///
/// # Panics
/// When `x.len()` is not `tokens · w.cols()` or `chunk` does not divide the row's blocks.
pub fn matmul_chunked(w: &QMatrix, x: &[f32], tokens: usize, chunk: usize) -> Vec<f32> {
    assert_eq!(x.len(), tokens * w.cols());
    assert!(chunk > 0 && w.blocks().is_multiple_of(chunk));
    let chunks = w.blocks() / chunk;
    let a = quantize_acts(x, w.cols(), w.qtype().act_type());
    let rows = w.rows();
    let mut out = vec![0f32; tokens * rows * chunks];
    let ptr = OutPtr(out.as_mut_ptr());
    let isa = detect_isa();
    let tiles = rows.div_ceil(ROW_TILE);
    let item = |tile: usize| {
        let ptr = &ptr;
        let mut res = [0f32; MAX_TOKENS * 64];
        let per = chunks.min(64);
        for r in tile * ROW_TILE..((tile + 1) * ROW_TILE).min(rows) {
            let mut t0 = 0;
            while t0 < tokens {
                let n = (tokens - t0).min(MAX_TOKENS);
                if chunks <= 64 {
                    dot_chunks(isa, w, r, &a, t0, n, chunk, &mut res[..n * per]);
                    for t in 0..n {
                        let dst = ((t0 + t) * rows + r) * chunks;
                        for c in 0..chunks {
                            // SAFETY: (token, row r, chunk) belongs to this tile only.
                            unsafe { *ptr.0.add(dst + c) = res[t * chunks + c] };
                        }
                    }
                } else {
                    let mut big = vec![0f32; n * chunks];
                    dot_chunks(isa, w, r, &a, t0, n, chunk, &mut big);
                    for t in 0..n {
                        let dst = ((t0 + t) * rows + r) * chunks;
                        for c in 0..chunks {
                            // SAFETY: as above.
                            unsafe { *ptr.0.add(dst + c) = big[t * chunks + c] };
                        }
                    }
                }
                t0 += n;
            }
        }
    };
    pool::global().run(tiles, &item);
    out
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, QType};
    use super::*;

    #[test]
    fn matmul_is_the_same_for_any_token_count_and_close_to_f32() {
        let (rows, cols) = (40, 192);
        let bytes = super::super::format::tests::gguf_bytes(QType::Q4_1, rows, cols, 5);
        let w = QMatrix::from_gguf(QType::Q4_1, rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..7 * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
            .collect();
        let all = matmul(&w, &x, 7);
        for t in 0..7 {
            let one = matmul(&w, &x[t * cols..(t + 1) * cols], 1);
            assert_eq!(one, all[t * rows..(t + 1) * rows].to_vec(), "token {t}");
        }
        // Chunk partials add up to about the whole-row value.
        let parts = matmul_chunked(&w, &x, 7, 2);
        let mut wr = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&w, r, &mut wr);
            for t in 0..7 {
                let sum: f32 = parts[(t * rows + r) * 3..(t * rows + r) * 3 + 3]
                    .iter()
                    .sum();
                let f: f32 = wr.iter().zip(&x[t * cols..]).map(|(a, b)| a * b).sum();
                let mag: f32 = wr
                    .iter()
                    .zip(&x[t * cols..])
                    .map(|(a, b)| (a * b).abs())
                    .sum();
                assert!((sum - all[t * rows + r]).abs() <= 1e-5 * mag);
                assert!((f - all[t * rows + r]).abs() <= 2e-2 * mag);
            }
        }
    }
}
