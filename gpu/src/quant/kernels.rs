//! Dot products of weight rows with quantized activation rows: a scalar reference and x86
//! AVX2 / AVX-512 VNNI paths that equal it bit for bit (module docs of `quant`).

use super::format::{QActs, QMatrix, QType, RowRef, QK, ROW_GROUP};
use super::isa::{assert_supported, hsum8, Isa, MAX_TOKENS, PREFETCH_BYTES};
use super::kquants;

/// Weight row `r` against activation rows `tok0 .. tok0 + n` (`n ≤ 4`), block range split in
/// chunks of `chunk` blocks: `out[t * chunks + c]` is token `t`'s partial dot product over
/// chunk `c` (each chunk accumulated and summed as one llama.cpp `vec_dot`).
///
/// # Panics
/// When `n` is 0 or above 4, `chunk` does not divide the row's blocks, or `isa` is not
/// supported by this CPU.
#[allow(clippy::too_many_arguments)]
pub fn dot_chunks(
    isa: Isa,
    w: &QMatrix,
    r: usize,
    a: &QActs,
    tok0: usize,
    n: usize,
    chunk: usize,
    out: &mut [f32],
) {
    let nb = w.blocks();
    assert!((1..=MAX_TOKENS).contains(&n) && chunk > 0 && nb.is_multiple_of(chunk));
    assert_eq!(a.blocks(), nb);
    assert_eq!(a.act_type(), w.qtype().act_type());
    let chunks = nb / chunk;
    let row = (!w.qtype().is_k_quant()).then(|| w.row(r));
    for c in 0..chunks {
        let blocks = c * chunk..(c + 1) * chunk;
        let mut res = [0f32; MAX_TOKENS];
        match isa {
            _ if w.qtype().is_k_quant() => kquants::dot(isa, w, r, a, tok0, n, blocks, &mut res),
            Isa::Scalar => scalar(w.qtype(), row.unwrap(), a, tok0, n, blocks, &mut res),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni => {
                assert_supported(isa);
                let row = row.unwrap();
                // SAFETY: the features each path needs were detected above.
                unsafe { x86::dispatch(isa, w.qtype(), row, a, tok0, n, blocks, &mut res) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => scalar(w.qtype(), row.unwrap(), a, tok0, n, blocks, &mut res),
        }
        for t in 0..n {
            out[t * chunks + c] = res[t];
        }
    }
}

/// Rows that one call of the single-token kernel ([`dot_rows`]) takes: one group of rows,
/// which share an array of scales (see [`QMatrix`]).
pub(crate) const GEMV_ROWS: usize = ROW_GROUP;

/// Decode's GEMV: the `groups` groups of weight rows `r0 .. r0 + groups · GEMV_ROWS` against
/// activation row `tok`, block range split in chunks of `chunk` blocks: `out[i * chunks + c]`
/// is row `r0 + i`'s partial dot product over chunk `c`, with the same bits as [`dot_chunks`]
/// gives that row. One call runs a whole tile of rows (the checks are made once per tile,
/// and the kernel's prefetch runs on from one group into the next).
///
/// # Panics
/// When the rows or the token are out of range, `r0` does not start a group, `chunk` does not
/// divide the row's blocks, `out` is too short, or `isa` is not supported by this CPU.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_rows(
    isa: Isa,
    w: &QMatrix,
    r0: usize,
    groups: usize,
    a: &QActs,
    tok: usize,
    chunk: usize,
    out: &mut [f32],
) {
    let nb = w.blocks();
    let rows = groups * GEMV_ROWS;
    assert!(chunk > 0 && nb.is_multiple_of(chunk) && r0 + rows <= w.rows());
    assert!(
        r0.is_multiple_of(GEMV_ROWS),
        "a group of rows starts at a multiple of {GEMV_ROWS}"
    );
    assert!(a.blocks() == nb && tok < a.rows() && a.act_type() == w.qtype().act_type());
    let chunks = nb / chunk;
    assert!(out.len() >= rows * chunks);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni if !w.qtype().is_k_quant() => {
            assert_supported(isa);
            // SAFETY: the features each path needs were detected above.
            unsafe { x86::dispatch_rows(isa, w, r0, groups, a, tok, chunk, out) }
        }
        _ => {
            for g in 0..groups {
                let g0 = r0 + g * GEMV_ROWS;
                for c in 0..chunks {
                    let blocks = c * chunk..(c + 1) * chunk;
                    let mut res = [[0f32; 1]; GEMV_ROWS];
                    if w.qtype().is_k_quant() {
                        kquants::tile(isa, w, g0, a, tok, blocks, &mut res);
                    } else {
                        for (i, res) in res.iter_mut().enumerate() {
                            let mut one = [0f32; MAX_TOKENS];
                            scalar(
                                w.qtype(),
                                w.row(g0 + i),
                                a,
                                tok,
                                1,
                                blocks.clone(),
                                &mut one,
                            );
                            res[0] = one[0];
                        }
                    }
                    for (i, v) in res.iter().enumerate() {
                        out[(g * GEMV_ROWS + i) * chunks + c] = v[0];
                    }
                }
            }
        }
    }
}

/// Weight rows and tokens per call of the multi-token kernel ([`dot_tile`]): one group of rows.
pub(crate) const TILE_ROWS: usize = ROW_GROUP;
/// See [`TILE_ROWS`].
pub(crate) const TILE_TOKENS: usize = 4;

/// Where the prefill kernel writes: a `[tokens, stride, chunks]` array of partial dot products
/// (a matmul's output, or several matmuls' outputs side by side per token), by raw pointer, so
/// that each result is stored once, in place. A matrix's row `r` is the array's row
/// `offset + r`.
#[derive(Clone, Copy)]
pub(crate) struct OutView {
    ptr: *mut f32,
    stride: usize,
    offset: usize,
    chunks: usize,
}

impl OutView {
    /// # Safety
    /// `ptr` is valid for writes of `tokens · stride · chunks` floats for every token a kernel
    /// is given, and nothing reads them while kernels write.
    pub(crate) unsafe fn new(ptr: *mut f32, stride: usize, offset: usize, chunks: usize) -> Self {
        Self {
            ptr,
            stride,
            offset,
            chunks,
        }
    }

    /// # Safety
    /// As [`new`](Self::new), and `(tok, offset + row, c)` is in the array.
    #[inline]
    unsafe fn put(&self, tok: usize, row: usize, c: usize, v: f32) {
        // SAFETY: by the function's contract.
        unsafe {
            self.ptr
                .add((tok * self.stride + self.offset + row) * self.chunks + c)
                .write(v)
        }
    }

    /// Whether the array has room for a matrix of `rows` rows from its offset, in `chunks`
    /// chunks.
    pub(crate) fn covers(&self, rows: usize, chunks: usize) -> bool {
        self.offset + rows <= self.stride && self.chunks == chunks
    }

    /// Writes `v` at `(tok, row0 + i, c)` for each `i` (one store run when the array has one
    /// chunk).
    ///
    /// # Safety
    /// As [`new`](Self::new), and those entries are in the array.
    #[inline]
    pub(crate) unsafe fn put_rows(&self, tok: usize, row0: usize, c: usize, v: &[f32]) {
        // SAFETY (both arms): by the function's contract.
        unsafe {
            if self.chunks == 1 {
                let at = self.ptr.add(tok * self.stride + self.offset + row0);
                std::ptr::copy_nonoverlapping(v.as_ptr(), at, v.len());
            } else {
                for (i, &x) in v.iter().enumerate() {
                    self.put(tok, row0 + i, c, x);
                }
            }
        }
    }
}

/// Prefill's GEMM tiles: weight rows `r0 .. r0 + TILE_ROWS` against `groups` groups of
/// [`TILE_TOKENS`] activation rows from `tok0`, block range split in chunks of `chunk` blocks:
/// writes `out`'s `(tok, r, c)` for those tokens and rows, each token's partial dot product
/// with the row over chunk `c`, with the same bits as [`dot_chunks`] gives it.
///
/// # Safety
/// `out` has room for `w.rows()` rows from its offset and `w.blocks() / chunk` chunks, and holds the tokens
/// up to `tok0 + groups · TILE_TOKENS`; no one else writes or reads those entries meanwhile.
///
/// # Panics
/// When the rows or tokens are out of range, `chunk` does not divide the row's blocks, or
/// `isa` is not supported by this CPU.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_tile(
    isa: Isa,
    w: &QMatrix,
    r0: usize,
    a: &QActs,
    tok0: usize,
    groups: usize,
    chunk: usize,
    out: OutView,
) {
    let nb = w.blocks();
    assert!(chunk > 0 && nb.is_multiple_of(chunk) && r0 + TILE_ROWS <= w.rows());
    assert!(
        w.qtype().is_k_quant() || r0.is_multiple_of(TILE_ROWS),
        "a group of rows starts at a multiple of {TILE_ROWS}"
    );
    assert!(a.blocks() == nb && tok0 + groups * TILE_TOKENS <= a.rows());
    assert!(a.act_type() == w.qtype().act_type());
    let chunks = nb / chunk;
    assert!(out.offset + w.rows() <= out.stride && out.chunks == chunks);
    // SAFETY (every `put`): the entries are the caller's (the function's contract).
    for c in 0..chunks {
        let blocks = c * chunk..(c + 1) * chunk;
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni if !w.qtype().is_k_quant() => {
                assert_supported(isa);
                for g0 in (0..groups).step_by(MAX_GROUPS) {
                    let n = (groups - g0).min(MAX_GROUPS);
                    let t0 = tok0 + g0 * TILE_TOKENS;
                    // SAFETY: the features each path needs were detected above.
                    unsafe { x86::dispatch_tile(isa, w, r0, a, t0, n, blocks.clone(), c, out) }
                }
            }
            _ => {
                for g in 0..groups {
                    let tok = tok0 + g * TILE_TOKENS;
                    let mut res = [[0f32; TILE_TOKENS]; TILE_ROWS];
                    if w.qtype().is_k_quant() {
                        kquants::tile(isa, w, r0, a, tok, blocks.clone(), &mut res);
                    } else {
                        for (i, res) in res.iter_mut().enumerate() {
                            let mut four = [0f32; MAX_TOKENS];
                            let row = w.row(r0 + i);
                            scalar(
                                w.qtype(),
                                row,
                                a,
                                tok,
                                TILE_TOKENS,
                                blocks.clone(),
                                &mut four,
                            );
                            res.copy_from_slice(&four[..TILE_TOKENS]);
                        }
                    }
                    for (i, res) in res.iter().enumerate() {
                        for (t, v) in res.iter().enumerate() {
                            unsafe { out.put(tok + t, r0 + i, c, *v) };
                        }
                    }
                }
            }
        }
    }
}

/// Token groups one call of the x86 tile kernel runs.
const MAX_GROUPS: usize = 16;

/// Weight block `b` as 32 signed integers in activation order.
#[inline]
fn unpack(qt: QType, row: RowRef<'_>, b: usize) -> [i32; QK] {
    let mut x = [0i32; QK];
    match qt {
        QType::Q8_0 => {
            for (j, x) in x.iter_mut().enumerate() {
                *x = row.qs[b * 32 + j] as i8 as i32;
            }
        }
        QType::Q4_0 | QType::Q4_1 => {
            let off = if qt == QType::Q4_0 { 8 } else { 0 };
            for j in 0..16 {
                let q = row.qs[b * 16 + j];
                x[j] = (q & 0x0f) as i32 - off;
                x[j + 16] = (q >> 4) as i32 - off;
            }
        }
        QType::Q4K | QType::Q6K => unreachable!("the k-quants run in `kquants`"),
    }
    x
}

fn scalar(
    qt: QType,
    row: RowRef<'_>,
    a: &QActs,
    tok0: usize,
    n: usize,
    blocks: std::ops::Range<usize>,
    out: &mut [f32; MAX_TOKENS],
) {
    let nb = a.blocks();
    for (t, out) in out.iter_mut().enumerate().take(n) {
        let tok = tok0 + t;
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for b in blocks.clone() {
            let ab = tok * nb + b;
            let x = unpack(qt, row, b);
            let y = &a.qs[ab * QK..(ab + 1) * QK];
            let dd = row.d(b) * a.d[ab];
            for (l, acc) in acc.iter_mut().enumerate() {
                let lane: i32 = (4 * l..4 * l + 4).map(|j| x[j] * y[j] as i32).sum();
                *acc = dd.mul_add(lane as f32, *acc);
            }
            if qt == QType::Q4_1 {
                summs = row.m(b).mul_add(a.s[ab], summs);
            }
        }
        *out = if qt == QType::Q4_1 {
            hsum8(acc) + summs
        } else {
            hsum8(acc)
        };
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{
        Isa, OutView, QActs, QMatrix, QType, RowRef, GEMV_ROWS, MAX_TOKENS, PREFETCH_BYTES, QK,
        ROW_GROUP, TILE_ROWS, TILE_TOKENS,
    };
    use crate::quant::isa::x86::hsum;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::ops::Range;

    /// Block `b`'s scale or minimum of a row ([`RowRef`]'s `d` or `m`) as f32, by F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn half_to_f32(src: &[u8], b: usize) -> f32 {
        let bits = u16::from_le_bytes([src[8 * b], src[8 * b + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Generates the three block-format kernels for one way of forming the integer lanes
    /// (`$us8(ax, sy)`: eight i32 lanes of four u8 × i8 products each).
    macro_rules! kernels {
        ($name:ident, $features:literal, $us8:ident) => {
            mod $name {
                use super::*;

                #[inline]
                #[target_feature(enable = $features)]
                fn nibbles(qs: *const u8) -> __m256i {
                    // SAFETY: callers pass a pointer to 16 readable bytes.
                    let tmp = unsafe { _mm_loadu_si128(qs as *const __m128i) };
                    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
                    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
                }

                /// Signed × signed through the unsigned-by-signed product: `|x| · sign(y, x)`.
                #[inline]
                #[target_feature(enable = $features)]
                fn mul_i8(x: __m256i, y: __m256i) -> __m256 {
                    let ax = _mm256_sign_epi8(x, x);
                    let sy = _mm256_sign_epi8(y, x);
                    _mm256_cvtepi32_ps($us8(ax, sy))
                }

                /// A block's 32 weights as bytes in activation order (`Q`: 0 Q4_0, signed;
                /// 1 Q4_1, unsigned; 2 Q8_0, signed).
                ///
                /// # Safety
                /// `qp` points at the block's quants (16 bytes, 32 for Q8_0).
                #[inline]
                #[target_feature(enable = $features)]
                pub(super) unsafe fn quants<const Q: u8>(qp: *const u8) -> __m256i {
                    match Q {
                        1 => nibbles(qp),
                        0 => _mm256_sub_epi8(nibbles(qp), _mm256_set1_epi8(8)),
                        // SAFETY: by the function's contract.
                        _ => unsafe { _mm256_loadu_si256(qp as *const __m256i) },
                    }
                }

                /// The eight f32 lanes of four products each of weights `qx` ([`quants`])
                /// and activations `qy`.
                #[inline]
                #[target_feature(enable = $features)]
                fn lanes<const Q: u8>(qx: __m256i, qy: __m256i) -> __m256 {
                    match Q {
                        1 => _mm256_cvtepi32_ps($us8(qx, qy)),
                        _ => mul_i8(qx, qy),
                    }
                }

                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = $features)]
                pub(super) fn run<const NT: usize>(
                    qt: QType,
                    row: RowRef<'_>,
                    a: &QActs,
                    tok0: usize,
                    blocks: Range<usize>,
                    out: &mut [f32; MAX_TOKENS],
                ) {
                    let nb = a.blocks();
                    let mut acc = [_mm256_setzero_ps(); NT];
                    let mut summs = [0f32; NT];
                    let qb = qt.quant_bytes();
                    for b in blocks {
                        let wd = half_to_f32(row.d, b);
                        let wm = if qt == QType::Q4_1 {
                            half_to_f32(row.m, b)
                        } else {
                            0.0
                        };
                        // SAFETY: `b` is a block of this row, so its quants are in `row.qs`.
                        let qp = unsafe { row.qs.as_ptr().add(b * qb) };
                        let qx = match qt {
                            QType::Q4_1 => nibbles(qp),
                            QType::Q4_0 => _mm256_sub_epi8(nibbles(qp), _mm256_set1_epi8(8)),
                            // SAFETY: 32 bytes of quants.
                            QType::Q8_0 => unsafe { _mm256_loadu_si256(qp as *const __m256i) },
                            QType::Q4K | QType::Q6K => unreachable!("run in `kquants`"),
                        };
                        for t in 0..NT {
                            let ab = (tok0 + t) * nb + b;
                            // SAFETY: `ab` indexes an activation block of 32 quants.
                            let qy = unsafe {
                                _mm256_loadu_si256(a.qs.as_ptr().add(ab * QK) as *const __m256i)
                            };
                            let xy = match qt {
                                QType::Q4_1 => _mm256_cvtepi32_ps($us8(qx, qy)),
                                _ => mul_i8(qx, qy),
                            };
                            let dd = _mm256_set1_ps(wd * a.d[ab]);
                            acc[t] = _mm256_fmadd_ps(dd, xy, acc[t]);
                            if qt == QType::Q4_1 {
                                summs[t] = wm.mul_add(a.s[ab], summs[t]);
                            }
                        }
                    }
                    for t in 0..NT {
                        let h = hsum(acc[t]);
                        out[t] = if qt == QType::Q4_1 { h + summs[t] } else { h };
                    }
                }

                /// [`tile`] for each of `groups` groups of [`TILE_TOKENS`] tokens in turn (one
                /// call: the groups share the rows, which stay in L1), each result stored in
                /// `out` at (`tok0 +` its token, `r0 +` its row, chunk `c`).
                ///
                /// # Safety
                /// `o` was built by [`Operands::new`] for a group of rows and
                /// `groups · TILE_TOKENS` tokens; `out`'s entries for those are the caller's.
                #[target_feature(enable = $features)]
                #[allow(dead_code)] // The VNNI path runs `zmm::tiles` instead.
                pub(super) unsafe fn tiles<const Q: u8>(
                    o: &Operands,
                    groups: usize,
                    (tok0, r0, c): (usize, usize, usize),
                    out: OutView,
                ) {
                    for g in 0..groups {
                        let mut res = [[0f32; TILE_TOKENS]; TILE_ROWS];
                        // SAFETY: group `g`'s tokens are among the operands', and their
                        // entries of `out` the caller's.
                        unsafe {
                            tile::<Q>(&o.tokens(g * TILE_TOKENS), &mut res);
                            for t in 0..TILE_TOKENS {
                                for (i, res) in res.iter().enumerate() {
                                    out.put(tok0 + g * TILE_TOKENS + t, r0 + i, c, res[t]);
                                }
                            }
                        }
                    }
                }

                /// Prefill's GEMM tile: the [`TILE_ROWS`] weight rows of a group against
                /// [`TILE_TOKENS`] activation rows, blocks `b0..b1` of [`Operands`]. Each
                /// (row, token) does `run::<1>`'s float operations in the same order, so its
                /// result has the same bits, but the scalar work of a block is taken out of the
                /// integer loop: a span of blocks' scale products `d_w · d_a` are formed first,
                /// the group's four rows per instruction (the inner loop broadcasts each from
                /// memory), and the minimums' terms `Σ m_w · s_a` likewise, four rows per
                /// fused multiply-add in block order. `out[i][t]`: row `i`, token `t`.
                ///
                /// # Safety
                /// `o` was built by [`Operands::new`] for a group of rows and `TILE_TOKENS`
                /// tokens.
                #[target_feature(enable = $features)]
                pub(super) unsafe fn tile<const Q: u8>(
                    o: &Operands,
                    out: &mut [[f32; TILE_TOKENS]; TILE_ROWS],
                ) {
                    const R: usize = TILE_ROWS;
                    const T: usize = TILE_TOKENS;
                    /// Blocks whose scale products are formed per pass.
                    const SPAN: usize = 64;
                    let Operands {
                        qs: w,
                        qs_stride,
                        d: dp,
                        m: mp,
                        nb,
                        b0,
                        b1,
                        aq,
                        ad,
                        asum,
                        ..
                    } = *o;
                    let qb = if Q == 2 { 32 } else { 16 };
                    let mut acc = [[_mm256_setzero_ps(); T]; R];
                    // `dd[k][t]`: the four rows' scale products of the span's block `k` for
                    // token `t`. Written before read, block by block (no zeroing: it cost 13 %
                    // of a prefill as a memset per tile).
                    let mut dd = [[MaybeUninit::<__m128>::uninit(); T]; SPAN];
                    // The minimums' terms, one vector of the rows per token.
                    let mut sm = [_mm_setzero_ps(); T];
                    // SAFETY (all pointer reads): in bounds by the function's contract; `dd` is
                    // indexed below `e - b ≤ SPAN`, and a span's entries are all written before
                    // any is read.
                    unsafe {
                        let mut b = b0;
                        while b < b1 {
                            let e = (b + SPAN).min(b1);
                            for k in b..e {
                                let wd =
                                    _mm_cvtph_ps(_mm_loadl_epi64(dp.add(8 * k) as *const __m128i));
                                for t in 0..T {
                                    let da = _mm_set1_ps(*ad.add(t * nb + k));
                                    dd[k - b][t].write(_mm_mul_ps(wd, da));
                                }
                                if Q == 1 {
                                    let wm = _mm_cvtph_ps(_mm_loadl_epi64(
                                        mp.add(8 * k) as *const __m128i
                                    ));
                                    for t in 0..T {
                                        let sa = _mm_set1_ps(*asum.add(t * nb + k));
                                        sm[t] = _mm_fmadd_ps(wm, sa, sm[t]);
                                    }
                                }
                            }
                            for k in b..e {
                                let mut qy = [_mm256_setzero_si256(); T];
                                for t in 0..T {
                                    qy[t] = _mm256_loadu_si256(
                                        aq.add((t * nb + k) * QK) as *const __m256i
                                    );
                                }
                                let dk = dd.get_unchecked(k - b);
                                for i in 0..R {
                                    let qx = quants::<Q>(w.add(i * qs_stride + k * qb));
                                    for t in 0..T {
                                        let xy = lanes::<Q>(qx, qy[t]);
                                        let s = *(dk[t].as_ptr() as *const f32).add(i);
                                        acc[i][t] =
                                            _mm256_fmadd_ps(_mm256_set1_ps(s), xy, acc[i][t]);
                                    }
                                }
                            }
                            b = e;
                        }
                    }
                    let mut summs = [[0f32; R]; T];
                    for t in 0..T {
                        // SAFETY: four floats into four.
                        unsafe { _mm_storeu_ps(summs[t].as_mut_ptr(), sm[t]) };
                    }
                    for i in 0..R {
                        for t in 0..T {
                            let h = hsum(acc[i][t]);
                            out[i][t] = if Q == 1 { h + summs[t][i] } else { h };
                        }
                    }
                }

                /// [`gemv`] on `groups` consecutive groups of rows, each row's blocks in
                /// chunks of `chunk`: `out[(g · GEMV_ROWS + i) · chunks + c]` is group `g`'s
                /// row `i` over chunk `c`.
                ///
                /// # Safety
                /// `o` was built by [`Operands::new`] for `groups` groups, one token and all
                /// the row's blocks; `chunk` divides them and `out` holds
                /// `groups · GEMV_ROWS · chunks` values.
                #[target_feature(enable = $features)]
                pub(super) unsafe fn gemv_rows<const Q: u8>(
                    o: &Operands,
                    groups: usize,
                    chunk: usize,
                    out: &mut [f32],
                ) {
                    let chunks = o.nb / chunk;
                    for g in 0..groups {
                        let og = o.group(g);
                        for c in 0..chunks {
                            let mut res = [[0f32; 1]; GEMV_ROWS];
                            // SAFETY: group `g` and chunk `c` are among the operands', and
                            // `out` holds every group's rows' chunks.
                            unsafe {
                                gemv::<Q>(&og.blocks(c * chunk..(c + 1) * chunk), &mut res);
                                for (i, v) in res.iter().enumerate() {
                                    *out.get_unchecked_mut((g * GEMV_ROWS + i) * chunks + c) = v[0];
                                }
                            }
                        }
                    }
                }

                /// Decode's GEMV: the [`GEMV_ROWS`] weight rows of a group against one
                /// activation row, blocks `b0..b1` of [`Operands`] (`Q`: 0 Q4_0, 1 Q4_1, 2
                /// Q8_0). Per block the activations are loaded once for the four rows, and the
                /// rows' four scales (and minimums) are converted and multiplied by the
                /// activation's scale with one instruction each (the group's interleaved
                /// scales); each row's product is then broadcast to its eight lanes. Every row
                /// does exactly `run::<1>`'s float operations in the same order, so its result
                /// has the same bits. The next groups' bytes are prefetched as these are
                /// computed (a row is too short for the hardware prefetcher to learn).
                ///
                /// # Safety
                /// `o` was built by [`Operands::new`] for a group of rows and one token.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn gemv<const Q: u8>(o: &Operands, out: &mut [[f32; 1]; GEMV_ROWS]) {
                    let Operands {
                        qs: w,
                        qs_stride,
                        d: dp,
                        m: mp,
                        group_bytes,
                        nb: _,
                        b0,
                        b1,
                        aq,
                        ad,
                        asum,
                    } = *o;
                    let qb = if Q == 2 { 32 } else { 16 };
                    let ahead = PREFETCH_BYTES.next_multiple_of(group_bytes);
                    let mut acc = [_mm256_setzero_ps(); GEMV_ROWS];
                    let mut sm = _mm_setzero_ps();
                    // SAFETY (all pointer reads): in bounds by the function's contract.
                    // Prefetches may point past the matrix: they never fault.
                    unsafe {
                        for b in b0..b1 {
                            if (b - b0) % 8 == 0 {
                                // A cache line holds eight blocks' scales.
                                _mm_prefetch::<_MM_HINT_T1>(
                                    dp.wrapping_add(ahead + 8 * b) as *const i8
                                );
                                if Q == 1 {
                                    _mm_prefetch::<_MM_HINT_T1>(
                                        mp.wrapping_add(ahead + 8 * b) as *const i8
                                    );
                                }
                            }
                            let qy = _mm256_loadu_si256(aq.add(b * QK) as *const __m256i);
                            let wd = _mm_cvtph_ps(_mm_loadl_epi64(dp.add(8 * b) as *const __m128i));
                            let dd =
                                _mm256_castps128_ps256(_mm_mul_ps(wd, _mm_set1_ps(*ad.add(b))));
                            if Q == 1 {
                                let wm =
                                    _mm_cvtph_ps(_mm_loadl_epi64(mp.add(8 * b) as *const __m128i));
                                sm = _mm_fmadd_ps(wm, _mm_set1_ps(*asum.add(b)), sm);
                            }
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let qp = w.add(i * qs_stride + b * qb);
                                _mm_prefetch::<_MM_HINT_T1>(qp.wrapping_add(ahead) as *const i8);
                                let xy = lanes::<Q>(quants::<Q>(qp), qy);
                                let di = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(i as i32));
                                *acc = _mm256_fmadd_ps(di, xy, *acc);
                            }
                        }
                    }
                    let mut summs = [0f32; GEMV_ROWS];
                    // SAFETY: four floats into four.
                    unsafe { _mm_storeu_ps(summs.as_mut_ptr(), sm) };
                    for i in 0..GEMV_ROWS {
                        let h = hsum(acc[i]);
                        out[i][0] = if Q == 1 { h + summs[i] } else { h };
                    }
                }
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn us8_avx2(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    fn us8_vnni(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
    }

    kernels!(avx2, "avx2,fma,f16c", us8_avx2);
    kernels!(vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", us8_vnni);

    /// Prefill's GEMM tile on 512-bit registers (the [`Isa::Avx512Vnni`] path): two tokens'
    /// eight lanes side by side in one register, so each instruction does two (row, token)
    /// pairs' work. Every lane holds exactly the integer sum, float conversion and fused
    /// multiply-adds the 256-bit `tile` gives it, in the same block order, and the
    /// halves are summed by the same [`hsum`]: the results have the same bits.
    ///
    /// The signed × signed products of Q4_0 / Q8_0 weights with Q8_0 activations use
    /// `vpdpbusd` on the activations shifted to unsigned, `Σ w·(a + 128) − 128·Σ w`, the
    /// correction formed once per row and block and used as the accumulator's start (exact in
    /// i32) — 512-bit AVX-512 has no `vpsignb`, the 256-bit path's way to the same sums.
    /// About 1.4× the 256-bit tile's speed on Q8_0 (`cargo bench --bench q8_kernels` with
    /// `PDSERVE_QUANT_ISA=avx2` against the default).
    mod zmm {
        use super::*;

        /// As the 256-bit `tiles`: each of `groups` groups of [`TILE_TOKENS`] tokens in turn.
        ///
        /// # Safety
        /// As the 256-bit `tiles`, and the CPU runs AVX-512 F/VL/VNNI.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        pub(super) unsafe fn tiles<const Q: u8>(
            o: &Operands,
            groups: usize,
            (tok0, r0, c): (usize, usize, usize),
            out: OutView,
        ) {
            for g in 0..groups {
                let mut res = [[0f32; TILE_TOKENS]; TILE_ROWS];
                // SAFETY: group `g`'s tokens are among the operands', and their entries of
                // `out` the caller's.
                unsafe {
                    tile::<Q>(&o.tokens(g * TILE_TOKENS), &mut res);
                    for t in 0..TILE_TOKENS {
                        for (i, res) in res.iter().enumerate() {
                            out.put(tok0 + g * TILE_TOKENS + t, r0 + i, c, res[t]);
                        }
                    }
                }
            }
        }

        /// The 256-bit `tile`'s results (`out[i][t]`: row `i`, token `t`), two tokens per
        /// register.
        ///
        /// # Safety
        /// As the 256-bit `tile`, and the CPU runs AVX-512 F/VL/VNNI.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        unsafe fn tile<const Q: u8>(o: &Operands, out: &mut [[f32; TILE_TOKENS]; TILE_ROWS]) {
            const R: usize = TILE_ROWS;
            const T: usize = TILE_TOKENS;
            /// Token pairs per tile.
            const P: usize = TILE_TOKENS / 2;
            /// Blocks whose scale products are formed per pass.
            const SPAN: usize = 64;
            let Operands {
                qs: w,
                qs_stride,
                d: dp,
                m: mp,
                nb,
                b0,
                b1,
                aq,
                ad,
                asum,
                ..
            } = *o;
            let qb = if Q == 2 { 32 } else { 16 };
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            // `dd[k]`: the span's block `k`'s scale products, token-major (`t · R + i`).
            let mut dd = [MaybeUninit::<[f32; R * T]>::uninit(); SPAN];
            // Lane `l` of pair `p`, row `i`: the product of token `2p + l / 8`.
            let mut idx = [[_mm512_setzero_si512(); P]; R];
            for (i, row) in idx.iter_mut().enumerate() {
                for (p, v) in row.iter_mut().enumerate() {
                    let lo = _mm256_set1_epi32(((2 * p) * R + i) as i32);
                    let hi = _mm256_set1_epi32(((2 * p + 1) * R + i) as i32);
                    *v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                }
            }
            let bias = _mm512_set1_epi8(-128);
            let mut sm = [_mm_setzero_ps(); T];
            // SAFETY (all pointer reads): in bounds by the function's contract; `dd` is
            // indexed below `e - b ≤ SPAN`, and a span's entries are all written before any
            // is read.
            unsafe {
                let mut b = b0;
                while b < b1 {
                    let e = (b + SPAN).min(b1);
                    for k in b..e {
                        let wd = _mm_cvtph_ps(_mm_loadl_epi64(dp.add(8 * k) as *const __m128i));
                        let row = dd.get_unchecked_mut(k - b).as_mut_ptr() as *mut f32;
                        for t in 0..T {
                            let da = _mm_set1_ps(*ad.add(t * nb + k));
                            _mm_storeu_ps(row.add(t * R), _mm_mul_ps(wd, da));
                        }
                        if Q == 1 {
                            let wm = _mm_cvtph_ps(_mm_loadl_epi64(mp.add(8 * k) as *const __m128i));
                            for (t, sm) in sm.iter_mut().enumerate() {
                                let sa = _mm_set1_ps(*asum.add(t * nb + k));
                                *sm = _mm_fmadd_ps(wm, sa, *sm);
                            }
                        }
                    }
                    for k in b..e {
                        // The pairs' activations, two tokens per register (shifted to
                        // unsigned for the signed weight formats).
                        let mut ay = [_mm512_setzero_si512(); P];
                        for (p, ay) in ay.iter_mut().enumerate() {
                            let lo =
                                _mm256_loadu_si256(aq.add((2 * p * nb + k) * QK) as *const __m256i);
                            let hi = _mm256_loadu_si256(
                                aq.add(((2 * p + 1) * nb + k) * QK) as *const __m256i
                            );
                            let y = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                            *ay = if Q == 1 { y } else { _mm512_xor_si512(y, bias) };
                        }
                        let ddk = _mm512_loadu_ps(dd.get_unchecked(k - b).as_ptr() as *const f32);
                        for i in 0..R {
                            let qx = vnni::quants::<Q>(w.add(i * qs_stride + k * qb));
                            let qx = _mm512_broadcast_i64x4(qx);
                            // Signed weights: start from `−128 · Σ w` per lane.
                            let start = if Q == 1 {
                                _mm512_setzero_si512()
                            } else {
                                _mm512_sub_epi32(
                                    _mm512_setzero_si512(),
                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, qx),
                                )
                            };
                            for p in 0..P {
                                let sums = if Q == 1 {
                                    _mm512_dpbusd_epi32(start, qx, ay[p])
                                } else {
                                    _mm512_dpbusd_epi32(start, ay[p], qx)
                                };
                                let xy = _mm512_cvtepi32_ps(sums);
                                let sc = _mm512_permutexvar_ps(idx[i][p], ddk);
                                acc[i][p] = _mm512_fmadd_ps(sc, xy, acc[i][p]);
                            }
                        }
                    }
                    b = e;
                }
            }
            let mut summs = [[0f32; R]; T];
            for t in 0..T {
                // SAFETY: four floats into four.
                unsafe { _mm_storeu_ps(summs[t].as_mut_ptr(), sm[t]) };
            }
            for (i, row) in acc.iter().enumerate() {
                for (p, &a) in row.iter().enumerate() {
                    let lo = _mm512_castps512_ps256(a);
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
                    for (t, half) in [(2 * p, lo), (2 * p + 1, hi)] {
                        let h = hsum(half);
                        out[i][t] = if Q == 1 { h + summs[t][i] } else { h };
                    }
                }
            }
        }
    }

    /// Raw operands of a kernel call on the group of rows from `r0` and activation rows
    /// `tok0 .. tok0 + toks`, after checking that they are all in bounds.
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        /// The group's first row's quants; row `i`'s are `i · qs_stride` further on.
        qs: *const u8,
        qs_stride: usize,
        /// The group's scales and (Q4_1) minimums: block `b`'s four at `8 · b`.
        d: *const u8,
        m: *const u8,
        /// Bytes from one group to the next (for prefetching).
        group_bytes: usize,
        nb: usize,
        b0: usize,
        b1: usize,
        aq: *const i8,
        ad: *const f32,
        asum: *const f32,
    }

    impl Operands {
        /// The same operands for the `g`-th group after theirs.
        fn group(&self, g: usize) -> Self {
            let by = g * self.group_bytes;
            Self {
                qs: self.qs.wrapping_add(by),
                d: self.d.wrapping_add(by),
                m: self.m.wrapping_add(by),
                ..*self
            }
        }

        /// The same operands over `blocks`.
        fn blocks(&self, blocks: Range<usize>) -> Self {
            Self {
                b0: blocks.start,
                b1: blocks.end,
                ..*self
            }
        }

        /// The same operands from their `t`-th token on.
        fn tokens(&self, t: usize) -> Self {
            let ab = t * self.nb;
            Self {
                aq: self.aq.wrapping_add(ab * QK),
                ad: self.ad.wrapping_add(ab),
                asum: self.asum.wrapping_add(ab),
                ..*self
            }
        }

        /// Operands of the groups `r0 / ROW_GROUP ..` (`groups` of them), the group the
        /// operands name being the first.
        #[allow(clippy::too_many_arguments)]
        fn new(
            w: &QMatrix,
            r0: usize,
            groups: usize,
            a: &QActs,
            tok0: usize,
            toks: usize,
            blocks: &Range<usize>,
        ) -> Self {
            let (qt, nb) = (w.qtype(), w.blocks());
            assert!(blocks.start <= blocks.end && blocks.end <= nb);
            assert!((tok0 + toks) * nb <= a.d.len());
            assert!(qt != QType::Q4_1 || (tok0 + toks) * nb <= a.s.len());
            let ad = a.d[tok0 * nb..].as_ptr();
            // In bounds: `groups` checks that the rows are, and that `r0` starts a group.
            let group = w.groups(r0, groups).as_ptr();
            let qs_stride = nb * qt.quant_bytes();
            let d = group.wrapping_add(ROW_GROUP * qs_stride);
            Self {
                qs: group,
                qs_stride,
                d,
                m: d.wrapping_add(ROW_GROUP * 2 * nb),
                group_bytes: w.group_bytes(),
                nb,
                b0: blocks.start,
                b1: blocks.end,
                aq: a.qs[tok0 * nb * QK..].as_ptr(),
                ad,
                asum: if qt == QType::Q4_1 {
                    a.s[tok0 * nb..].as_ptr()
                } else {
                    ad
                },
            }
        }
    }

    /// # Safety
    /// The CPU must support `isa`'s features.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dispatch_tile(
        isa: Isa,
        w: &QMatrix,
        r0: usize,
        a: &QActs,
        tok0: usize,
        groups: usize,
        blocks: Range<usize>,
        c: usize,
        out: OutView,
    ) {
        let qt = w.qtype();
        let o = Operands::new(w, r0, 1, a, tok0, groups * TILE_TOKENS, &blocks);
        let at = (tok0, r0, c);
        // SAFETY: the caller checked the features; rows, tokens and blocks are in bounds
        // (asserted above).
        unsafe {
            macro_rules! go {
                ($m:ident) => {
                    match qt {
                        QType::Q4_0 => $m::tiles::<0>(&o, groups, at, out),
                        QType::Q4_1 => $m::tiles::<1>(&o, groups, at, out),
                        QType::Q8_0 => $m::tiles::<2>(&o, groups, at, out),
                        QType::Q4K | QType::Q6K => unreachable!("run in `kquants`"),
                    }
                };
            }
            match isa {
                Isa::Avx512Vnni => go!(zmm),
                _ => go!(avx2),
            }
        }
    }

    /// # Safety
    /// The CPU must support `isa`'s features.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dispatch_rows(
        isa: Isa,
        w: &QMatrix,
        r0: usize,
        groups: usize,
        a: &QActs,
        tok: usize,
        chunk: usize,
        out: &mut [f32],
    ) {
        let o = Operands::new(w, r0, groups, a, tok, 1, &(0..w.blocks()));
        assert!(chunk > 0 && w.blocks().is_multiple_of(chunk));
        assert!(out.len() >= groups * GEMV_ROWS * (w.blocks() / chunk));
        // SAFETY: the caller checked the features; the rows, blocks and output are in bounds
        // (asserted above).
        unsafe {
            macro_rules! go {
                ($m:ident) => {
                    match w.qtype() {
                        QType::Q4_0 => $m::gemv_rows::<0>(&o, groups, chunk, out),
                        QType::Q4_1 => $m::gemv_rows::<1>(&o, groups, chunk, out),
                        QType::Q8_0 => $m::gemv_rows::<2>(&o, groups, chunk, out),
                        QType::Q4K | QType::Q6K => unreachable!("run in `kquants`"),
                    }
                };
            }
            match isa {
                Isa::Avx512Vnni => go!(vnni),
                _ => go!(avx2),
            }
        }
    }

    /// # Safety
    /// The CPU must support `isa`'s features.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dispatch(
        isa: Isa,
        qt: QType,
        row: RowRef<'_>,
        a: &QActs,
        tok0: usize,
        n: usize,
        blocks: Range<usize>,
        out: &mut [f32; MAX_TOKENS],
    ) {
        // SAFETY (all calls below): the caller checked the features.
        unsafe {
            macro_rules! go {
                ($m:ident) => {
                    match n {
                        1 => $m::run::<1>(qt, row, a, tok0, blocks, out),
                        2 => $m::run::<2>(qt, row, a, tok0, blocks, out),
                        3 => $m::run::<3>(qt, row, a, tok0, blocks, out),
                        _ => $m::run::<4>(qt, row, a, tok0, blocks, out),
                    }
                };
            }
            match isa {
                Isa::Avx512Vnni => go!(vnni),
                _ => go!(avx2),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, quantize_acts, QMatrix, QType};
    use super::super::isa::detect_isa;
    use super::*;

    fn gguf(qt: QType, rows: usize, cols: usize, seed: u32) -> QMatrix {
        let bytes = super::super::format::tests::gguf_bytes(qt, rows, cols, seed);
        QMatrix::from_gguf(qt, rows, cols, &bytes).unwrap()
    }

    fn acts(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| (((i * 7919 + 13) % 2003) as f32 - 1001.0) / 333.0)
            .collect()
    }

    const TYPES: [QType; 3] = [QType::Q4_0, QType::Q4_1, QType::Q8_0];

    /// Every format with a row width (whole blocks) and the chunk sizes (in blocks) to try.
    fn cases() -> Vec<(QType, usize, [usize; 3])> {
        let mut cases: Vec<_> = TYPES.iter().map(|&qt| (qt, 576, [18, 6, 1])).collect();
        cases.extend([QType::Q4K, QType::Q6K].map(|qt| (qt, 1024, [4, 2, 1])));
        cases
    }

    fn all(isa: Isa, w: &QMatrix, a: &super::super::format::QActs, chunk: usize) -> Vec<f32> {
        let chunks = w.blocks() / chunk;
        let toks = a.rows();
        let mut out = vec![0f32; w.rows() * toks * chunks];
        for r in 0..w.rows() {
            let mut t0 = 0;
            while t0 < toks {
                let n = (toks - t0).min(MAX_TOKENS);
                let base = (r * toks + t0) * chunks;
                dot_chunks(
                    isa,
                    w,
                    r,
                    a,
                    t0,
                    n,
                    chunk,
                    &mut out[base..base + n * chunks],
                );
                t0 += n;
            }
        }
        out
    }

    #[test]
    fn simd_paths_equal_the_scalar_reference_bit_for_bit() {
        let best = detect_isa();
        let isas: Vec<Isa> = match best {
            Isa::Scalar => vec![],
            Isa::Avx2 => vec![Isa::Avx2],
            Isa::Avx512Vnni => vec![Isa::Avx2, Isa::Avx512Vnni],
        };
        if isas.is_empty() {
            eprintln!("no SIMD path on this CPU: nothing to compare");
        }
        for (qt, cols, chunks) in cases() {
            let w = gguf(qt, 5, cols, 3);
            let a = quantize_acts(&acts(7, cols), cols, qt.act_type());
            for chunk in chunks {
                let want = all(Isa::Scalar, &w, &a, chunk);
                for &isa in &isas {
                    let got = all(isa, &w, &a, chunk);
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{qt:?} {isa:?} chunk {chunk}: {want:?} != {got:?}");
                }
            }
        }
    }

    /// The scalar reference and every SIMD path this CPU runs.
    fn every_isa() -> Vec<Isa> {
        match detect_isa() {
            Isa::Scalar => vec![Isa::Scalar],
            Isa::Avx2 => vec![Isa::Scalar, Isa::Avx2],
            Isa::Avx512Vnni => vec![Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni],
        }
    }

    #[test]
    fn the_multi_row_gemv_equals_one_row_at_a_time_bit_for_bit() {
        let isas = every_isa();
        for (qt, cols, chunk_sizes) in cases() {
            // Three groups of rows and a padded one.
            let w = gguf(qt, 3 * GEMV_ROWS + 1, cols, 21);
            let a = quantize_acts(&acts(3, cols), cols, qt.act_type());
            for chunk in chunk_sizes {
                let chunks = w.blocks() / chunk;
                for &isa in &isas {
                    for tok in 0..3 {
                        for (r0, groups) in [(0, 1), (GEMV_ROWS, 2), (0, 3)] {
                            let mut got = vec![0f32; groups * GEMV_ROWS * chunks];
                            dot_rows(isa, &w, r0, groups, &a, tok, chunk, &mut got);
                            for i in 0..groups * GEMV_ROWS {
                                let mut want = vec![0f32; chunks];
                                dot_chunks(isa, &w, r0 + i, &a, tok, 1, chunk, &mut want);
                                let got = &got[i * chunks..(i + 1) * chunks];
                                assert!(
                                    want.iter().zip(got).all(|(x, y)| x.to_bits() == y.to_bits()),
                                    "{qt:?} {isa:?} chunk {chunk} row {} tok {tok}: {want:?} != {got:?}",
                                    r0 + i
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_gemm_tile_equals_one_row_at_a_time_bit_for_bit() {
        let isas = every_isa();
        // 18 blocks: one span of scale products with a tail of 2; 139 blocks: spans of
        // 64, 64 and 11. 17 token groups: more than one x86 call takes.
        let mut cases: Vec<(QType, usize, usize)> = cases()
            .into_iter()
            .flat_map(|(qt, cols, chunks)| chunks.map(|c| (qt, cols, c)))
            .collect();
        cases.extend(TYPES.iter().map(|&qt| (qt, 139 * QK, 139)));
        for (qt, cols, chunk) in cases {
            let w = gguf(qt, 3 * TILE_ROWS + 1, cols, 33);
            let a = quantize_acts(&acts(TILE_TOKENS * 17 + 2, cols), cols, qt.act_type());
            let chunks = w.blocks() / chunk;
            for &isa in &isas {
                for (r0, tok0, groups) in [(0, 0, 1), (TILE_ROWS, 2, 3), (2 * TILE_ROWS, 1, 17)] {
                    // The whole `[tokens, rows, chunks]` output, NaN where nothing may write.
                    let (toks, rows) = (tok0 + groups * TILE_TOKENS, w.rows());
                    let mut got = vec![f32::NAN; toks * rows * chunks];
                    // SAFETY: `got` holds every token up to `toks` for every row and chunk.
                    unsafe {
                        let out = OutView::new(got.as_mut_ptr(), rows, 0, chunks);
                        dot_tile(isa, &w, r0, &a, tok0, groups, chunk, out);
                    }
                    for (at, v) in got.iter().enumerate() {
                        let (t, r) = (at / chunks / rows, at / chunks % rows);
                        let mine = t >= tok0 && (r0..r0 + TILE_ROWS).contains(&r);
                        assert_eq!(v.is_nan(), !mine, "entry {at} (token {t}, row {r})");
                    }
                    for i in 0..TILE_ROWS {
                        for t in tok0..toks {
                            let mut want = vec![0f32; chunks];
                            dot_chunks(isa, &w, r0 + i, &a, t, 1, chunk, &mut want);
                            let at = (t * rows + r0 + i) * chunks;
                            let got = &got[at..at + chunks];
                            assert!(
                                want.iter()
                                    .zip(got)
                                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                                "{qt:?} {isa:?} chunk {chunk} row {} token {t}: {want:?} != {got:?}",
                                r0 + i,
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn token_grouping_does_not_change_a_result() {
        // One token at a time and four at a time give the same bits (batch invariance).
        let isa = detect_isa();
        for (qt, _, _) in cases() {
            let w = gguf(qt, 3, 512, 9);
            let a = quantize_acts(&acts(4, 512), 512, qt.act_type());
            let grouped = all(isa, &w, &a, w.blocks());
            for r in 0..3 {
                for t in 0..4 {
                    let mut one = [0f32; 1];
                    dot_chunks(isa, &w, r, &a, t, 1, w.blocks(), &mut one);
                    assert_eq!(one[0].to_bits(), grouped[r * 4 + t].to_bits());
                }
            }
        }
    }

    #[test]
    fn scalar_reference_is_close_to_dequantize_then_f32() {
        for qt in TYPES {
            let (rows, cols) = (4, 320);
            let w = gguf(qt, rows, cols, 11);
            let x = acts(2, cols);
            let a = quantize_acts(&x, cols, qt.act_type());
            let got = all(Isa::Scalar, &w, &a, w.blocks());
            let mut wrow = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(&w, r, &mut wrow);
                for t in 0..2 {
                    let xr = &x[t * cols..(t + 1) * cols];
                    // The exact product of the dequantized weights and activations…
                    let deq_a: Vec<f32> = (0..cols)
                        .map(|j| a.qs[t * cols + j] as f32 * a.d[t * cols / 32 + j / 32])
                        .collect();
                    let exact: f64 = wrow
                        .iter()
                        .zip(&deq_a)
                        .map(|(&w, &x)| w as f64 * x as f64)
                        .sum();
                    // …and the product with the unquantized activations.
                    let f32_ref: f64 = wrow
                        .iter()
                        .zip(xr)
                        .map(|(&w, &x)| w as f64 * x as f64)
                        .sum();
                    let scale: f64 = wrow
                        .iter()
                        .zip(xr)
                        .map(|(&w, &x)| (w as f64 * x as f64).abs())
                        .sum();
                    let v = got[r * 2 + t] as f64;
                    // Q4_1's minimum term uses s in f16: allow for that rounding.
                    let tight = if qt == QType::Q4_1 { 2e-3 } else { 1e-5 };
                    assert!((v - exact).abs() <= tight * scale, "{qt:?} {v} vs {exact}");
                    assert!(
                        (v - f32_ref).abs() <= 2e-2 * scale,
                        "{qt:?} {v} vs {f32_ref}"
                    );
                }
            }
        }
    }
}
