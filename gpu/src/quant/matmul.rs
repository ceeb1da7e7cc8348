//! Matmuls of a quantized weight matrix with f32 activation rows, split over the compute
//! pool by tiles of weight rows. Every (weight row, token) result is computed by the same
//! kernel call sequence whatever the tile, the thread or the number of tokens, so results do
//! not depend on batch composition.

use super::format::{quantize_acts, QActs, QMatrix};
use super::isa::{detect_isa, Isa, MAX_TOKENS};
use super::kernels::{dot_chunks, dot_rows, dot_tile, OutView, GEMV_ROWS, TILE_ROWS, TILE_TOKENS};
use super::pool;
use super::rows16;

/// Weight rows per work item: small enough for the two threads to balance a 576-row matrix,
/// large enough to amortise claiming.
const ROW_TILE: usize = 16;

/// Weight rows per work item of a single-token matmul (decode's GEMV) over `rows` rows: about
/// a quarter of the matrix per item at two threads (two items per thread, so a descheduled
/// thread's second item goes to the other), between 16 and 256 rows. Long runs of consecutive
/// rows per thread keep the prefetchers ahead of the kernel: at 16 rows per item the two
/// threads' interleaved claims ran the default model's decode ~35 % slower.
fn gemv_tile(rows: usize, threads: usize) -> usize {
    rows.div_ceil(2 * threads.max(1))
        .next_multiple_of(GEMV_ROWS)
        .clamp(16, 256)
}

/// Token groups of [`TILE_TOKENS`] per prefill kernel call (the call's rows stay in L1 while
/// it runs them all).
const TILE_GROUPS: usize = 8;

/// Fewest tokens a matmul runs on [`rows16`] (where it runs at all): below that its gathering
/// of the weights per call costs more than it saves.
const ROWS16_MIN_TOKENS: usize = 4;

/// Batches below this many tokens run [`rows16`] over long runs of rows with the next rows
/// prefetched (their weights come from memory, as decode's do); larger ones, whose weights
/// stay in cache across the tokens, over tiles of [`ROW_TILE`] rows.
const ROWS16_PREFETCH_BELOW: usize = 32;

/// Where one matrix's results go: a `[tokens, stride, chunks]` array, the matrix's row `r`
/// at its row `offset + r` (`stride` is the matrix's rows unless several matrices share one
/// output side by side).
struct OutPtr {
    ptr: *mut f32,
    stride: usize,
    offset: usize,
    chunks: usize,
}
// SAFETY: items write disjoint index sets of the output (see `run_tile`).
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Index of `(tok, row, chunk 0)` in the array.
    #[inline]
    fn at(&self, tok: usize, row: usize) -> usize {
        (tok * self.stride + self.offset + row) * self.chunks
    }

    /// Writes `src` at `dst` with plain stores: most copies are 4–16 floats, for which a
    /// `memcpy` call per copy took a fifth of a prefill.
    ///
    /// # Safety
    /// `dst .. dst + src.len()` is inside the output and written by this work item only.
    #[inline]
    unsafe fn put(&self, dst: usize, src: &[f32]) {
        // SAFETY (all writes): by the function's contract. The fixed sizes stay plain
        // stores (a loop would become a `memcpy` call again).
        unsafe {
            let at = self.ptr.add(dst);
            match src.len() {
                1 => at.write(src[0]),
                4 => (at as *mut [f32; 4]).write_unaligned(src.try_into().expect("4")),
                _ => std::ptr::copy_nonoverlapping(src.as_ptr(), at, src.len()),
            }
        }
    }
}

/// `x` is `[tokens, cols]` row-major; returns `[tokens, rows]`: each value one llama.cpp
/// `vec_dot` over the whole row.
///
/// # Panics
/// When `x.len()` is not `tokens · w.cols()`.
pub fn matmul(w: &QMatrix, x: &[f32], tokens: usize) -> Vec<f32> {
    matmul_chunked(w, x, tokens, w.blocks())
}

/// As [`matmul`], with each row's blocks (super-blocks for the k-quants) reduced in chunks of
/// `chunk` blocks: returns `[tokens, rows, blocks / chunk]` partial sums (row-parallel layers
/// add them in a fixed order, so the result does not depend on how the columns were sharded).
///
/// # Panics
/// When `x.len()` is not `tokens · w.cols()` or `chunk` does not divide the row's blocks.
pub fn matmul_chunked(w: &QMatrix, x: &[f32], tokens: usize, chunk: usize) -> Vec<f32> {
    let chunks = w.blocks() / chunk;
    let n = tokens * w.rows() * chunks;
    // Filled by the work items before its length is set (not zeroed first: every value is
    // written once).
    let mut out = Vec::with_capacity(n);
    let ptr = OutPtr {
        ptr: out.as_mut_ptr(),
        stride: w.rows(),
        offset: 0,
        chunks,
    };
    run(&[(w, chunk)], x, tokens, &[ptr]);
    // SAFETY: the tiles cover every (token, row, chunk) and each wrote its values (`run`
    // returns once every item has run; a panicking item panics there).
    unsafe { out.set_len(n) };
    out
}

/// Several matrices that read the same input (Q, K and V; gate and up): the activations are
/// quantized once and all the matrices' rows run as one job on the pool. Returns one
/// `[tokens, rows]` output per matrix (split from [`matmul_concat`]'s joined rows), each value
/// with the bits [`matmul`] gives it.
///
/// # Panics
/// When the matrices differ in columns or activation format, or `x.len()` is not
/// `tokens · cols`.
pub fn matmul_many(ws: &[&QMatrix], x: &[f32], tokens: usize) -> Vec<Vec<f32>> {
    let joined = matmul_concat(ws, x, tokens);
    let width: usize = ws.iter().map(|w| w.rows()).sum();
    let mut at = 0;
    ws.iter()
        .map(|w| {
            let cols = at..at + w.rows();
            at += w.rows();
            joined
                .chunks(width)
                .flat_map(|row| &row[cols.clone()])
                .copied()
                .collect()
        })
        .collect()
}

/// As [`matmul_many`], with the outputs side by side: returns `[tokens, Σ rows]`, each token's
/// row the matrices' results in order (Q|K|V, gate|up), each value with the bits [`matmul`]
/// gives it. Written in place: no per-token concatenation afterwards.
///
/// # Panics
/// As [`matmul_many`].
pub fn matmul_concat(ws: &[&QMatrix], x: &[f32], tokens: usize) -> Vec<f32> {
    let jobs: Vec<(&QMatrix, usize)> = ws.iter().map(|w| (*w, w.blocks())).collect();
    let width: usize = ws.iter().map(|w| w.rows()).sum();
    let mut out = Vec::with_capacity(tokens * width);
    let mut offset = 0;
    let ptrs: Vec<OutPtr> = ws
        .iter()
        .map(|w| {
            let p = OutPtr {
                ptr: out.as_mut_ptr(),
                stride: width,
                offset,
                chunks: 1,
            };
            offset += w.rows();
            p
        })
        .collect();
    run(&jobs, x, tokens, &ptrs);
    // SAFETY: the matrices' rows tile `0..width` and `run` wrote every (token, row) of each.
    unsafe { out.set_len(tokens * width) };
    out
}

/// Runs every job's tiles as one pool job, writing job `j`'s results through `outs[j]`.
/// Returns once every `(token, row, chunk)` of every job has been written (each exactly once).
fn run(jobs: &[(&QMatrix, usize)], x: &[f32], tokens: usize, outs: &[OutPtr]) {
    let (w0, _) = jobs[0];
    assert_eq!(x.len(), tokens * w0.cols());
    assert_eq!(jobs.len(), outs.len());
    for (&(w, chunk), o) in jobs.iter().zip(outs) {
        assert!(w.cols() == w0.cols() && w.qtype().act_type() == w0.qtype().act_type());
        assert!(chunk > 0 && w.blocks().is_multiple_of(chunk));
        assert!(o.chunks == w.blocks() / chunk && o.offset + w.rows() <= o.stride);
    }
    let a = quantize_acts(x, w0.cols(), w0.qtype().act_type());
    // First global tile of each job.
    let mut firsts = Vec::with_capacity(jobs.len() + 1);
    let mut tiles = 0;
    let threads = pool::global().threads();
    let isa = detect_isa();
    let tile_rows: Vec<usize> = jobs
        .iter()
        .map(|&(w, _)| {
            if tokens == 1 {
                gemv_tile(w.rows(), threads)
            } else if tokens < ROWS16_PREFETCH_BELOW && rows16::runs(isa, w.qtype()) {
                // A small batch streams the weights as decode does: long runs of rows per
                // item, the next rows prefetched while these run.
                gemv_tile(w.rows(), threads).next_multiple_of(rows16::ROWS)
            } else {
                ROW_TILE
            }
        })
        .collect();
    for (&(w, _), &tr) in jobs.iter().zip(&tile_rows) {
        firsts.push(tiles);
        tiles += w.rows().div_ceil(tr);
    }
    let item = |tile: usize| {
        let j = firsts.partition_point(|&f| f <= tile) - 1;
        let (w, chunk) = jobs[j];
        run_tile(
            isa,
            w,
            chunk,
            &a,
            tokens,
            tile_rows[j],
            tile - firsts[j],
            &outs[j],
        );
    };
    pool::global().run(tiles, &item);
}

/// Rows `tile · tile_rows ..` of `w` into `out` (`[tokens, rows, chunks]`).
#[allow(clippy::too_many_arguments)]
fn run_tile(
    isa: Isa,
    w: &QMatrix,
    chunk: usize,
    a: &QActs,
    tokens: usize,
    tile_rows: usize,
    tile: usize,
    out: &OutPtr,
) {
    let rows = w.rows();
    let chunks = w.blocks() / chunk;
    let end = ((tile + 1) * tile_rows).min(rows);
    let mut r = tile * tile_rows;
    // Results on their way to the output: decode's tile of rows, or one row's tokens.
    let need = if tokens == 1 {
        (end - r) * chunks
    } else {
        MAX_TOKENS * chunks
    };
    SCRATCH.with_borrow_mut(|res| {
        if res.len() < need {
            res.resize(need, 0.0);
        }
        if tokens == 1 {
            // Decode: the tile's whole groups of rows in one call (each group's rows share
            // each activation block).
            let groups = (end - r) / GEMV_ROWS;
            let n = groups * GEMV_ROWS * chunks;
            if n > 0 {
                dot_rows(isa, w, r, groups, a, 0, chunk, &mut res[..n]);
                // SAFETY: (token 0, the groups' rows, every chunk) belong to this tile only
                // (consecutive in the output: a token's rows are).
                unsafe { out.put(out.at(0, r), &res[..n]) };
                r += groups * GEMV_ROWS;
            }
        }
        if tokens >= ROWS16_MIN_TOKENS && rows16::runs(isa, w.qtype()) {
            // Prefill on AVX-512 VNNI: sixteen rows per register, all the tokens per call.
            // SAFETY: the output holds `tokens` tokens of the matrix's rows and `chunks` chunks
            // from its offset; (every token, rows r .. r + 16, every chunk) belong to this
            // tile only.
            unsafe {
                let view = OutView::new(out.ptr, out.stride, out.offset, chunks);
                while r + rows16::ROWS <= end {
                    if tokens < ROWS16_PREFETCH_BELOW {
                        rows16::prefetch(w, r + rows16::ROWS);
                    }
                    rows16::gemm(isa, w, r, a, 0..tokens, chunk, view);
                    r += rows16::ROWS;
                }
            }
        }
        if tokens >= TILE_TOKENS {
            // Prefill: tiles of rows × tokens, each row's weights unpacked once per block for
            // all the tile's tokens; the kernel stores each result in the output itself.
            let full = tokens - tokens % TILE_TOKENS;
            // SAFETY: the output holds `tokens` tokens of the matrix's rows and `chunks` chunks
            // from its offset.
            let view = unsafe { OutView::new(out.ptr, out.stride, out.offset, chunks) };
            while r + TILE_ROWS <= end {
                for t0 in (0..full).step_by(TILE_TOKENS * TILE_GROUPS) {
                    let groups = ((full - t0) / TILE_TOKENS).min(TILE_GROUPS);
                    // SAFETY: (tokens t0 .., rows r .. r + TILE_ROWS, every chunk) belong to
                    // this tile only.
                    unsafe { dot_tile(isa, w, r, a, t0, groups, chunk, view) };
                }
                for rr in r..r + TILE_ROWS {
                    rows_by_tokens(isa, w, chunk, a, full, tokens, rr, res, out);
                }
                r += TILE_ROWS;
            }
        }
        for r in r..end {
            rows_by_tokens(isa, w, chunk, a, 0, tokens, r, res, out);
        }
    });
}

thread_local! {
    /// Each compute thread's staging buffer for [`run_tile`] (grown, never zeroed again: a
    /// zeroed stack array per tile was a visible `memset` in prefill profiles).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Row `r` against tokens `from..tokens`, up to four tokens per kernel call.
#[allow(clippy::too_many_arguments)]
fn rows_by_tokens(
    isa: Isa,
    w: &QMatrix,
    chunk: usize,
    a: &QActs,
    from: usize,
    tokens: usize,
    r: usize,
    res: &mut [f32],
    out: &OutPtr,
) {
    let chunks = w.blocks() / chunk;
    let mut t0 = from;
    while t0 < tokens {
        let n = (tokens - t0).min(MAX_TOKENS);
        dot_chunks(isa, w, r, a, t0, n, chunk, &mut res[..n * chunks]);
        for t in 0..n {
            let dst = out.at(t0 + t, r);
            // SAFETY: (token, row r, every chunk) belongs to this tile only.
            unsafe { out.put(dst, &res[t * chunks..(t + 1) * chunks]) };
        }
        t0 += n;
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, QType};
    use super::*;

    #[test]
    fn matmul_is_the_same_for_any_token_count_and_close_to_f32() {
        // 42 rows: whole tiles, a last tile of 10 (two 4-row GEMV calls and two single rows).
        let (rows, cols) = (42, 192);
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
        // Several matrices sharing one quantized input give each one's own bits.
        let bytes2 = super::super::format::tests::gguf_bytes(QType::Q4_1, 19, cols, 6);
        let w2 = QMatrix::from_gguf(QType::Q4_1, 19, cols, &bytes2).unwrap();
        for tokens in [1, 7] {
            let xs = &x[..tokens * cols];
            let many = matmul_many(&[&w, &w2], xs, tokens);
            assert_eq!(many[0], matmul(&w, xs, tokens));
            assert_eq!(many[1], matmul(&w2, xs, tokens));
            // Side by side in one output: each token's row is the two results joined.
            let joined = matmul_concat(&[&w, &w2], xs, tokens);
            assert_eq!(joined.len(), tokens * (rows + 19));
            for (t, row) in joined.chunks(rows + 19).enumerate() {
                assert_eq!(row[..rows], many[0][t * rows..(t + 1) * rows], "token {t}");
                assert_eq!(row[rows..], many[1][t * 19..(t + 1) * 19], "token {t}");
            }
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

    #[test]
    fn k_quant_matmuls_match_candle_for_one_token_and_a_batch() {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        // 66 rows: whole 16-row tiles, 4-row GEMV and GEMM tiles, and two single rows.
        let (rows, cols) = (66, 512);
        let f: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7919 + 11) % 1009) as f32 - 504.0) / 2000.0)
            .collect();
        let ft = Tensor::from_vec(f, (rows, cols), &Device::Cpu).unwrap();
        let x: Vec<f32> = (0..7 * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
            .collect();
        let mut ws = Vec::new();
        for (qt, g) in [(QType::Q4K, GgmlDType::Q4K), (QType::Q6K, GgmlDType::Q6K)] {
            let qtensor = QTensor::quantize(&ft, g).unwrap();
            let w = QMatrix::from_gguf(qt, rows, cols, &qtensor.data().unwrap()).unwrap();
            assert_eq!(w.bytes(), qtensor.data().unwrap().len());
            let all = matmul(&w, &x, 7);
            let want = super::super::format::tests::candle_forward(qtensor, &x, 7);
            let mut wr = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(&w, r, &mut wr);
                for t in 0..7 {
                    let xr = &x[t * cols..(t + 1) * cols];
                    let f: f32 = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                    let mag: f32 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                    let got = all[t * rows + r];
                    // Both quantize the activations to Q8_K (≲ 1/127 of Σ|w·x| each; candle
                    // rounds halves away from zero, llama.cpp to even).
                    assert!(
                        (got - want[t * rows + r]).abs() <= 2e-2 * mag,
                        "{qt:?} {r} {t}"
                    );
                    assert!((got - f).abs() <= 2e-2 * mag, "{qt:?} {r} {t}");
                }
            }
            // One token at a time (decode's GEMV) gives the batch's bits (the GEMM tile).
            for t in 0..7 {
                let one = matmul(&w, &x[t * cols..(t + 1) * cols], 1);
                assert_eq!(
                    one,
                    all[t * rows..(t + 1) * rows].to_vec(),
                    "{qt:?} token {t}"
                );
            }
            // Per-super-block partials (the TP reduction chunks) add up to the whole row.
            let parts = matmul_chunked(&w, &x, 7, 1);
            for (i, v) in all.iter().enumerate() {
                let sum = parts[2 * i] + parts[2 * i + 1];
                assert!((sum - v).abs() <= 1e-5 * v.abs().max(1.0), "{qt:?} {i}");
            }
            ws.push(w);
        }
        // Q4_K and Q6_K share Q8_K activations: one quantization for both, each its own bits.
        for tokens in [1, 7] {
            let xs = &x[..tokens * cols];
            let many = matmul_many(&[&ws[0], &ws[1]], xs, tokens);
            assert_eq!(many[0], matmul(&ws[0], xs, tokens));
            assert_eq!(many[1], matmul(&ws[1], xs, tokens));
        }
    }
}
