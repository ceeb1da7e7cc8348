//! Prefill's llama.cpp-exact GEMM on AVX-512 VNNI with sixteen weight rows across each
//! register.
//!
//! The tile kernels in `kernels` hold one (row, token)'s eight llama.cpp lanes in a register,
//! so each block of each (row, token) costs a scale broadcast or permute besides its integer
//! sum, conversion and fused multiply-add, and the eight lanes are summed across the register
//! at the end. Here a 512-bit register holds one lane of sixteen rows for one token: lane `j`
//! (block elements `4j .. 4j + 4`) of rows `r0 .. r0 + 16`. One `vpdpbusd` forms the sixteen
//! rows' integer lane sums against the token's four activation bytes broadcast from memory,
//! the rows' scale products `d_w · d_a` are one vector per (token, block), the lanes are
//! summed register by register, and a token's sixteen results are one store.
//!
//! Per (row, token, block) the float operations are exactly `scalar`'s in `kernels`: each
//! integer lane converted to f32 and fused-multiply-added with `d_w · d_a`, the eight lanes
//! summed in `hsum_float_8`'s order, and (Q4_1) `Σ m_w · s_a` formed by fused multiply-adds in
//! block order and added last: the results have the same bits as every other path.
//!
//! The weights are transposed once per call into a per-thread buffer, unpacked to unsigned
//! bytes (`vpdpbusd` multiplies unsigned by signed): Q4_1's nibbles as they are, Q4_0's
//! nibble `u` standing for `u − 8` and Q8_0's byte `w` stored as `w + 128`, each lane's sum
//! then starting from `−8 · Σ y` or `−128 · Σ y` over its four activation bytes (exact in i32:
//! the lane integers are llama.cpp's).

use super::format::{QActs, QMatrix, QType, ROW_GROUP};
use super::isa::Isa;
use super::kernels::OutView;
use std::ops::Range;

/// Weight rows per call: one register of 32-bit lanes.
pub(crate) const ROWS: usize = 16;

/// Whether [`gemm`] runs `qt` on `isa`. `PDSERVE_QUANT_ROWS16=off` turns it off (for
/// measuring it against the four-row tile kernels, which then run instead).
pub(crate) fn runs(isa: Isa, qt: QType) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("PDSERVE_QUANT_ROWS16").as_deref() == Ok("off"));
    cfg!(target_arch = "x86_64")
        && !off
        && isa == Isa::Avx512Vnni
        && matches!(qt, QType::Q4_0 | QType::Q4_1 | QType::Q8_0)
}

/// Weight rows `r0 .. r0 + ROWS` against activation rows `tokens`, the row's blocks split in
/// chunks of `chunk` blocks: writes `out`'s `(tok, r, c)` for those tokens and rows, each
/// token's partial dot product with the row over chunk `c`, with the same bits as
/// [`dot_chunks`](super::kernels::dot_chunks) gives it.
///
/// # Safety
/// `out` holds the tokens up to `tokens.end`, `w.rows()` rows from its offset and
/// `w.blocks() / chunk` chunks; no one else writes or reads those entries meanwhile.
///
/// # Panics
/// When [`runs`] is false for `isa` and the weights' format, the CPU lacks `isa`, `r0` does not
/// start a group of rows or the rows or tokens are out of range, `chunk` does not divide the
/// row's blocks, or `out`'s shape does not fit.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    isa: Isa,
    w: &QMatrix,
    r0: usize,
    a: &QActs,
    tokens: Range<usize>,
    chunk: usize,
    out: OutView,
) {
    let (qt, nb) = (w.qtype(), w.blocks());
    assert!(runs(isa, qt), "rows16 runs Q4_0/Q4_1/Q8_0 on AVX-512 VNNI");
    super::isa::assert_supported(isa);
    assert!(chunk > 0 && nb.is_multiple_of(chunk));
    assert!(r0.is_multiple_of(ROW_GROUP) && r0 + ROWS <= w.rows());
    assert!(a.blocks() == nb && a.act_type() == qt.act_type());
    assert!(tokens.start <= tokens.end && tokens.end <= a.rows());
    assert!(a.d.len() >= tokens.end * nb && a.qs.len() >= tokens.end * nb * super::QK);
    assert!(qt != QType::Q4_1 || a.s.len() >= tokens.end * nb);
    assert!(out.covers(w.rows(), nb / chunk));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU runs AVX-512 VNNI (asserted), the operands are in bounds (asserted) and
    // `out`'s entries are the caller's.
    unsafe {
        x86::gemm(w, r0, a, tokens, chunk, out)
    }
}

/// Asks for rows `r0 .. r0 + ROWS`'s bytes in L2 (nothing when they are past the matrix):
/// called for the next call's rows while this one runs, so that a small batch, which reads
/// the weights from memory once for few tokens, does not wait on each row's cache misses in
/// turn.
pub(crate) fn prefetch(w: &QMatrix, r0: usize) {
    if r0 + ROWS > w.rows() || !r0.is_multiple_of(ROW_GROUP) || w.qtype().is_k_quant() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let bytes = w.groups(r0, ROWS / ROW_GROUP);
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch of an address inside the slice (prefetches never fault).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr() as *const i8) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::format::{QActs, QMatrix, QType, QK, ROW_GROUP};
    use super::super::kernels::OutView;
    use super::ROWS;
    use std::arch::x86_64::*;
    use std::cell::RefCell;
    use std::ops::Range;

    /// Registers per block in the unpacked weights: the eight lanes' unsigned bytes, then the
    /// rows' scales and (Q4_1) minimums as f32.
    const PER_BLOCK: usize = 10;

    thread_local! {
        /// Each compute thread's unpacked weights of the rows it runs (grown, never shrunk).
        static PACK: RefCell<Vec<__m512i>> = const { RefCell::new(Vec::new()) };
    }

    /// # Safety
    /// As [`super::gemm`], whose checks have passed.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn gemm(
        w: &QMatrix,
        r0: usize,
        a: &QActs,
        tokens: Range<usize>,
        chunk: usize,
        out: OutView,
    ) {
        let nb = w.blocks();
        PACK.with_borrow_mut(|pack| {
            if pack.len() < nb * PER_BLOCK {
                pack.resize(nb * PER_BLOCK, _mm512_setzero_si512());
            }
            let pack = &mut pack[..nb * PER_BLOCK];
            // SAFETY: the rows are in bounds (the caller's checks); `pack` has room.
            unsafe { unpack(w, r0, pack) };
            let mut t = tokens.start;
            // SAFETY (both calls): by the function's contract.
            unsafe {
                macro_rules! go {
                    ($q:literal) => {{
                        while t + 2 <= tokens.end {
                            run::<2, $q>(pack, a, t, nb, chunk, r0, out);
                            t += 2;
                        }
                        if t < tokens.end {
                            run::<1, $q>(pack, a, t, nb, chunk, r0, out);
                        }
                    }};
                }
                match w.qtype() {
                    QType::Q4_0 => go!(0),
                    QType::Q4_1 => go!(1),
                    _ => go!(2),
                }
            }
        });
    }

    /// Unpacks rows `r0 .. r0 + 16`'s blocks into `pack` ([`PER_BLOCK`] registers per block):
    /// register `j` of a block holds lane `j`'s four unsigned weight bytes of each row (row `r`
    /// in 32-bit lane `r`), then the rows' f16 scales and minimums as f32.
    ///
    /// # Safety
    /// Rows `r0 .. r0 + 16` exist and `r0` starts a group; `pack` holds `PER_BLOCK` registers
    /// per block of the row.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn unpack(w: &QMatrix, r0: usize, pack: &mut [__m512i]) {
        let (qt, nb) = (w.qtype(), w.blocks());
        let qb = qt.quant_bytes();
        let bytes = w.groups(r0, ROWS / ROW_GROUP);
        let t = Transpose::new(bytes, w.group_bytes(), nb * qb);
        let low = _mm512_set1_epi8(0x0f);
        let bias = _mm512_set1_epi8(-128);
        // A group's four f16 scales of block `k` are at `ROW_GROUP · stride + 8k`, its
        // minimums `ROW_GROUP · 2 · nb` further on.
        let d0 = ROW_GROUP * nb * qb;
        let m0 = d0 + ROW_GROUP * 2 * nb;
        let halves = |at: usize, k: usize| -> __m512 {
            let q: [i64; 4] = std::array::from_fn(|g| {
                let p = g * t.group_bytes + at + 8 * k;
                i64::from_le_bytes(bytes[p..p + 8].try_into().expect("8 bytes"))
            });
            _mm512_cvtph_ps(_mm256_setr_epi64x(q[0], q[1], q[2], q[3]))
        };
        for k in 0..nb {
            let blk = &mut pack[k * PER_BLOCK..(k + 1) * PER_BLOCK];
            // SAFETY (transposes): block `k`'s quants are inside every row.
            unsafe {
                if qt == QType::Q8_0 {
                    // Bytes `w` as `w + 128`: dwords 0‥3, then 4‥7.
                    for (h, four) in [t.dwords(k * 32), t.dwords(k * 32 + 16)].iter().enumerate() {
                        for (q, v) in four.iter().enumerate() {
                            blk[4 * h + q] = _mm512_xor_si512(*v, bias);
                        }
                    }
                } else {
                    // Dword `q`'s low nibbles are lane `q`, its high nibbles lane `q + 4`.
                    for (q, v) in t.dwords(k * 16).into_iter().enumerate() {
                        blk[q] = _mm512_and_si512(v, low);
                        blk[q + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low);
                    }
                }
            }
            blk[8] = _mm512_castps_si512(halves(d0, k));
            if qt == QType::Q4_1 {
                blk[9] = _mm512_castps_si512(halves(m0, k));
            }
        }
    }

    /// Sixteen rows' four dwords at one offset, turned into four registers of one dword each:
    /// each group's four rows' 16 bytes side by side (row `i`'s dword `q` in lane `4i + q`),
    /// then two rounds of two-source permutes — rows 0‥7 and 8‥15 with dwords (0, 1) and
    /// (2, 3) side by side, then each dword of all sixteen rows in one register. (Gathers
    /// instead made up half of a batch-of-8 decode.)
    struct Transpose {
        base: *const u8,
        group_bytes: usize,
        /// Bytes from one row of a group to the next.
        stride: usize,
        /// First round: lane `l` takes dword `2h + l / 8` of row `l % 8` (rows 4‥7 from the
        /// second source), for `h` 0 and 1.
        pair: [__m512i; 2],
        /// Second round: dword `2h + q % 2`'s half (`q % 2`) of rows 0‥7, then of rows 8‥15.
        join: [__m512i; 2],
    }

    impl Transpose {
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        fn new(bytes: &[u8], group_bytes: usize, stride: usize) -> Self {
            let lanes = |f: &dyn Fn(usize) -> i32| -> __m512i {
                let v: [i32; 16] = std::array::from_fn(f);
                // SAFETY: sixteen i32 into a register.
                unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) }
            };
            let pair = std::array::from_fn(|h| {
                lanes(&|l| {
                    let (q, r) = (2 * h + l / 8, l % 8);
                    (if r < 4 {
                        4 * r + q
                    } else {
                        16 + 4 * (r - 4) + q
                    }) as i32
                })
            });
            let join = std::array::from_fn(|h| {
                lanes(&|l| (8 * h + l % 8 + if l < 8 { 0 } else { 16 }) as i32)
            });
            Self {
                base: bytes.as_ptr(),
                group_bytes,
                stride,
                pair,
                join,
            }
        }

        /// Register `q`: dword `q` of the 16 bytes at `off` of each row, row `r` in lane `r`.
        ///
        /// # Safety
        /// `off + 16` is within every row's quants.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        unsafe fn dwords(&self, off: usize) -> [__m512i; 4] {
            // SAFETY: rows' quants are in the groups `base` points at (the caller's contract).
            let z: [__m512i; 4] = std::array::from_fn(|g| unsafe {
                let p = self.base.add(g * self.group_bytes + off);
                let x = |i: usize| _mm_loadu_si128(p.add(i * self.stride) as *const __m128i);
                let v = _mm512_castsi128_si512(x(0));
                let v = _mm512_inserti32x4::<1>(v, x(1));
                let v = _mm512_inserti32x4::<2>(v, x(2));
                _mm512_inserti32x4::<3>(v, x(3))
            });
            let [p, j] = [self.pair, self.join];
            let lo = [
                _mm512_permutex2var_epi32(z[0], p[0], z[1]),
                _mm512_permutex2var_epi32(z[0], p[1], z[1]),
            ];
            let hi = [
                _mm512_permutex2var_epi32(z[2], p[0], z[3]),
                _mm512_permutex2var_epi32(z[2], p[1], z[3]),
            ];
            std::array::from_fn(|q| _mm512_permutex2var_epi32(lo[q / 2], j[q % 2], hi[q / 2]))
        }
    }

    /// Tokens `tok .. tok + T` against the unpacked rows (`Q`: 0 Q4_0, 1 Q4_1, 2 Q8_0).
    ///
    /// # Safety
    /// `pack` was filled by [`unpack`] for these rows; the tokens, blocks and `out`'s entries
    /// are as [`super::gemm`] checked them.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn run<const T: usize, const Q: u8>(
        pack: &[__m512i],
        a: &QActs,
        tok: usize,
        nb: usize,
        chunk: usize,
        r0: usize,
        out: OutView,
    ) {
        let chunks = nb / chunk;
        let ones = _mm256_set1_epi8(1);
        for c in 0..chunks {
            let mut acc = [[_mm512_setzero_ps(); 8]; T];
            let mut sm = [_mm512_setzero_ps(); T];
            for k in c * chunk..(c + 1) * chunk {
                let blk = &pack[k * PER_BLOCK..(k + 1) * PER_BLOCK];
                let wd = _mm512_castsi512_ps(blk[8]);
                for t in 0..T {
                    let ab = (tok + t) * nb + k;
                    // SAFETY: `ab` is an activation block of the checked tokens.
                    let (ad, y) = unsafe { (*a.d.get_unchecked(ab), a.qs.as_ptr().add(ab * QK)) };
                    let dd = _mm512_mul_ps(wd, _mm512_set1_ps(ad));
                    // Signed formats: each lane starts from `−8 · Σ y` (Q4_0) or
                    // `−128 · Σ y` (Q8_0) over its four activation bytes.
                    let mut starts = [0i32; 8];
                    if Q != 1 {
                        // SAFETY: 32 activation bytes at `y`; eight i32 into eight.
                        unsafe {
                            let yv = _mm256_loadu_si256(y as *const __m256i);
                            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, yv);
                            let s = if Q == 0 {
                                _mm256_slli_epi32::<3>(s)
                            } else {
                                _mm256_slli_epi32::<7>(s)
                            };
                            let s = _mm256_sub_epi32(_mm256_setzero_si256(), s);
                            _mm256_storeu_si256(starts.as_mut_ptr() as *mut __m256i, s);
                        }
                    }
                    for (j, (acc, &start)) in acc[t].iter_mut().zip(&starts).enumerate() {
                        // SAFETY: bytes `4j .. 4j + 4` of the block's 32.
                        let yj = unsafe { (y.add(4 * j) as *const i32).read_unaligned() };
                        let sums = _mm512_dpbusd_epi32(
                            _mm512_set1_epi32(start),
                            blk[j],
                            _mm512_set1_epi32(yj),
                        );
                        *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sums), *acc);
                    }
                    if Q == 1 {
                        // SAFETY: as `ab` above (Q4_1 activations carry `s`).
                        let s = unsafe { *a.s.get_unchecked(ab) };
                        sm[t] =
                            _mm512_fmadd_ps(_mm512_castsi512_ps(blk[9]), _mm512_set1_ps(s), sm[t]);
                    }
                }
            }
            for t in 0..T {
                let l = &acc[t];
                // `hsum_float_8`'s tree, sixteen rows at a time.
                let h = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                    _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
                );
                let h = if Q == 1 { _mm512_add_ps(h, sm[t]) } else { h };
                let mut v = [0f32; ROWS];
                // SAFETY: sixteen floats into sixteen.
                unsafe { _mm512_storeu_ps(v.as_mut_ptr(), h) };
                // SAFETY: the entries are the caller's (checked shape).
                unsafe { out.put_rows(tok + t, r0, c, &v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{quantize_acts, QMatrix, QType};
    use super::super::isa::{detect_isa, Isa};
    use super::super::kernels::{dot_chunks, OutView};
    use super::*;

    #[test]
    fn sixteen_rows_per_register_equal_the_scalar_reference_bit_for_bit() {
        if detect_isa() != Isa::Avx512Vnni {
            eprintln!("skipped: this CPU has no AVX-512 VNNI (rows16 does not run here)");
            return;
        }
        // Two tiles of 16 rows (the second starting at a group other than the first), six
        // blocks per row, split in chunks of every divisor.
        let (rows, cols, tokens) = (36, 192, 5);
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for qt in [QType::Q4_0, QType::Q4_1, QType::Q8_0] {
            let bytes = super::super::format::tests::gguf_bytes(qt, rows, cols, 11);
            let w = QMatrix::from_gguf(qt, rows, cols, &bytes).unwrap();
            let a = quantize_acts(&x, cols, qt.act_type());
            for chunk in [1, 2, 3, 6] {
                let chunks = w.blocks() / chunk;
                // Odd token ranges too: pairs, then one alone.
                for toks in [0..1, 0..2, 1..4, 0..5] {
                    let mut got = vec![f32::NAN; tokens * rows * chunks];
                    for r0 in [0, 20] {
                        // SAFETY: the array holds every (token, row, chunk); one writer.
                        unsafe {
                            let out = OutView::new(got.as_mut_ptr(), rows, 0, chunks);
                            gemm(Isa::Avx512Vnni, &w, r0, &a, toks.clone(), chunk, out);
                        }
                    }
                    for r in (0..16).chain(20..36) {
                        for t in toks.clone() {
                            let mut want = vec![0f32; chunks];
                            dot_chunks(Isa::Scalar, &w, r, &a, t, 1, chunk, &mut want);
                            let at = (t * rows + r) * chunks;
                            let g: Vec<u32> =
                                got[at..at + chunks].iter().map(|v| v.to_bits()).collect();
                            let e: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(g, e, "{qt:?} chunk {chunk} token {t} row {r}");
                        }
                    }
                }
            }
        }
    }
}
