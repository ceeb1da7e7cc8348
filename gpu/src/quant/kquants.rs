//! Q4_K and Q6_K weight rows against Q8_K activation rows, with the numerics of llama.cpp's
//! AVX2 `ggml_vec_dot_q4_K_q8_K` / `ggml_vec_dot_q6_K_q8_K`.
//!
//! Per 256-element super-block, eight i32 lanes: lane `l` is the sum over the eight
//! 32-element groups `g` of `sc · Σ q·y` over the group's elements `4l .. 4l + 4`, `sc` the
//! scale of the 16 elements they belong to (sub-block `2g + l / 4`). Q6_K's `−32` offset is
//! taken out of each lane in integers: `32 · (bsums[2l]·sc[2l] + bsums[2l+1]·sc[2l+1])`. The
//! lanes are converted to f32 and accumulated by one fused multiply-add by `d_w · d_a` each;
//! Q4_K's minimums give four more lanes, `mins[2l]·s[2l] + mins[2l+1]·s[2l+1]` with
//! `s[k] = bsums[2k] + bsums[2k+1]`, accumulated by a fused multiply-add by `−d_a · dmin_w`.
//! At the end the eight lanes are summed in `hsum_float_8`'s order and (Q4_K) the four
//! minimum lanes as `(m0 + m2) + (m1 + m3)` added. All integer sums are exact, so the scalar
//! reference and the SIMD paths (AVX2: `vpmaddubsw` then `vpmaddwd` by the scale; AVX-512
//! VNNI: `vpdpbusd` then `vpmaddwd` by the scale) have the same bits.

use super::format::{q4k_scales_mins, q6k_quant, ActType, QActs, QMatrix, QType, QK_K};
use super::isa::{hsum8, Isa, MAX_TOKENS};
use std::ops::Range;

/// Weight rows `r0 .. r0 + R` against activation rows `tok0 .. tok0 + NT` over super-blocks
/// `blocks`: `out[i][t]` is one llama.cpp `vec_dot` of row `r0 + i` and token `tok0 + t`.
///
/// # Panics
/// When `w` is not a k-quant, the operands are out of range, or `isa` is not supported by
/// this CPU.
pub(super) fn tile<const R: usize, const NT: usize>(
    isa: Isa,
    w: &QMatrix,
    r0: usize,
    a: &QActs,
    tok0: usize,
    blocks: Range<usize>,
    out: &mut [[f32; NT]; R],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Vnni => {
            super::isa::assert_supported(isa);
            let o = x86::Operands::new(w, r0, R, a, tok0, NT, &blocks);
            // SAFETY: the features were checked above; the operands are in bounds (checked by
            // `Operands::new`).
            unsafe { x86::dispatch(isa, w.qtype(), &o, out) }
        }
        _ => {
            for (i, out) in out.iter_mut().enumerate() {
                for (t, out) in out.iter_mut().enumerate() {
                    let row = w.row_data(r0 + i);
                    *out = scalar(w.qtype(), row, a, tok0 + t, blocks.clone());
                }
            }
        }
    }
}

/// Weight row `r` against activation rows `tok0 .. tok0 + n` (`n ≤ 4`): `out[t]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn dot(
    isa: Isa,
    w: &QMatrix,
    r: usize,
    a: &QActs,
    tok0: usize,
    n: usize,
    blocks: Range<usize>,
    out: &mut [f32; MAX_TOKENS],
) {
    fn one<const NT: usize>(
        isa: Isa,
        w: &QMatrix,
        r: usize,
        a: &QActs,
        tok0: usize,
        blocks: Range<usize>,
        out: &mut [f32; MAX_TOKENS],
    ) {
        let mut res = [[0f32; NT]; 1];
        tile(isa, w, r, a, tok0, blocks, &mut res);
        out[..NT].copy_from_slice(&res[0]);
    }
    match n {
        1 => one::<1>(isa, w, r, a, tok0, blocks, out),
        2 => one::<2>(isa, w, r, a, tok0, blocks, out),
        3 => one::<3>(isa, w, r, a, tok0, blocks, out),
        _ => one::<4>(isa, w, r, a, tok0, blocks, out),
    }
}

/// The reference: llama.cpp's AVX2 float operations, lane by lane (module docs).
fn scalar(qt: QType, row: &[u8], a: &QActs, tok: usize, blocks: Range<usize>) -> f32 {
    assert!(qt.is_k_quant() && a.act_type() == ActType::Q8K);
    let (nb, bb) = (a.blocks(), qt.block_bytes());
    let mut acc = [0f32; 8];
    let mut acc_m = [0f32; 4];
    for b in blocks {
        let blk = &row[b * bb..(b + 1) * bb];
        let ab = tok * nb + b;
        let y = &a.qs[ab * QK_K..(ab + 1) * QK_K];
        let bs = &a.bsums[ab * 16..(ab + 1) * 16];
        let yd = a.d[ab];
        // Each element's quant and each 16 elements' scale.
        let mut q = [0u8; QK_K];
        let mut sc = [0i32; 16];
        let wd;
        match qt {
            QType::Q4K => {
                wd = f16_at(blk, 0);
                let (scales, mins) = q4k_scales_mins(&blk[4..16]);
                for (e, q) in q.iter_mut().enumerate() {
                    let byte = blk[16 + 32 * (e / 64) + e % 32];
                    *q = if e % 64 < 32 { byte & 0x0f } else { byte >> 4 };
                }
                for (h, sc) in sc.iter_mut().enumerate() {
                    *sc = scales[h / 2] as i32;
                }
                let s: Vec<i32> = (0..8)
                    .map(|k| bs[2 * k] as i32 + bs[2 * k + 1] as i32)
                    .collect();
                let dmin = -yd * f16_at(blk, 2);
                for (l, acc_m) in acc_m.iter_mut().enumerate() {
                    let prod =
                        mins[2 * l] as i32 * s[2 * l] + mins[2 * l + 1] as i32 * s[2 * l + 1];
                    *acc_m = dmin.mul_add(prod as f32, *acc_m);
                }
            }
            _ => {
                wd = f16_at(blk, 208);
                for (e, q) in q.iter_mut().enumerate() {
                    *q = q6k_quant(&blk[..128], &blk[128..192], e);
                }
                for (h, sc) in sc.iter_mut().enumerate() {
                    *sc = blk[192 + h] as i8 as i32;
                }
            }
        }
        let d = wd * yd;
        for (l, acc) in acc.iter_mut().enumerate() {
            let mut sumi = 0i32;
            for g in 0..8 {
                let p: i32 = (32 * g + 4 * l..32 * g + 4 * l + 4)
                    .map(|e| q[e] as i32 * y[e] as i32)
                    .sum();
                sumi += sc[2 * g + l / 4] * p;
            }
            if qt == QType::Q6K {
                sumi -= 32 * (bs[2 * l] as i32 * sc[2 * l] + bs[2 * l + 1] as i32 * sc[2 * l + 1]);
            }
            *acc = d.mul_add(sumi as f32, *acc);
        }
    }
    if qt == QType::Q4K {
        hsum8(acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
    } else {
        hsum8(acc)
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::format::{q4k_scales_mins, ActType, QActs, QMatrix, QType, QK_K};
    use super::super::isa::x86::{half_at, hsum};
    use super::super::isa::PREFETCH_BYTES;
    use super::Isa;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Raw operands of a kernel call on rows `r0 .. r0 + rows` and activation rows
    /// `tok0 .. tok0 + toks`, after checking that they are all in bounds.
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        base: *const u8,
        row_bytes: usize,
        nb: usize,
        b0: usize,
        b1: usize,
        aq: *const i8,
        ad: *const f32,
        bsums: *const i16,
    }

    impl Operands {
        pub(super) fn new(
            w: &QMatrix,
            r0: usize,
            rows: usize,
            a: &QActs,
            tok0: usize,
            toks: usize,
            blocks: &Range<usize>,
        ) -> Self {
            let nb = w.blocks();
            assert!(w.qtype().is_k_quant() && a.act_type() == ActType::Q8K);
            assert!(rows > 0 && r0 + rows <= w.rows() && blocks.end <= nb && a.blocks() == nb);
            assert!(toks > 0 && (tok0 + toks) * nb <= a.d.len());
            assert!((tok0 + toks) * nb * 16 <= a.bsums.len());
            assert!((tok0 + toks) * nb * QK_K <= a.qs.len());
            Self {
                base: w.row_data(r0).as_ptr(),
                row_bytes: w.row_bytes(),
                nb,
                b0: blocks.start,
                b1: blocks.end,
                aq: a.qs[tok0 * nb * QK_K..].as_ptr(),
                ad: a.d[tok0 * nb..].as_ptr(),
                bsums: a.bsums[tok0 * nb * 16..].as_ptr(),
            }
        }
    }

    /// Q4_K's minimum lanes summed as llama.cpp does: `(m0 + m2) + (m1 + m3)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum4(x: __m128) -> f32 {
        let r = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
    }

    /// Generates the k-quant kernels for one way of forming the scaled integer lanes:
    /// `$scale(lo, hi)` builds a scale operand (lanes 0..4 by `lo`, 4..8 by `hi`) and
    /// `$sdot(q, y, scale)` gives eight i32 lanes `scale · Σ` of four `u8 × i8` products.
    macro_rules! kernels {
        ($name:ident, $features:literal, $scale:ident, $sdot:ident) => {
            mod $name {
                use super::*;

                /// `R` consecutive weight rows against `NT` consecutive activation rows,
                /// super-blocks `b0..b1` of [`Operands`] (`Q`: 0 Q4_K, 1 Q6_K): per
                /// super-block each row's quants and scales are unpacked once for all the
                /// tokens. Every (row, token) does exactly the scalar reference's float
                /// operations in the same order. `out[i][t]`: row `i`, token `t`.
                ///
                /// # Safety
                /// `o` was built by [`Operands::new`] for `R` rows and `NT` tokens.
                #[target_feature(enable = $features)]
                pub(super) unsafe fn gemm<const Q: u8, const R: usize, const NT: usize>(
                    o: &Operands,
                    out: &mut [[f32; NT]; R],
                ) {
                    let Operands {
                        base: w,
                        row_bytes,
                        nb,
                        b0,
                        b1,
                        aq,
                        ad,
                        bsums,
                    } = *o;
                    let bb = if Q == 0 { 144 } else { 210 };
                    let m4 = _mm256_set1_epi8(0x0f);
                    let mut acc = [[_mm256_setzero_ps(); NT]; R];
                    let mut acc_m = [[_mm_setzero_ps(); NT]; R];
                    // SAFETY (all pointer reads): in bounds by the function's contract.
                    unsafe {
                        for b in b0..b1 {
                            for i in 0..R {
                                let blk = w.add(i * row_bytes + b * bb);
                                if NT == 1 {
                                    // Decode streams each row once: fetch the super-block
                                    // of the rows some 6 KiB on (whole calls) into L2
                                    // meanwhile, as the 32-element formats' GEMV does.
                                    let ahead = blk.wrapping_add(
                                        PREFETCH_BYTES.next_multiple_of(R * row_bytes),
                                    );
                                    for off in [0, 64, 128, bb - 1] {
                                        _mm_prefetch::<_MM_HINT_T1>(
                                            ahead.wrapping_add(off) as *const i8
                                        );
                                    }
                                }
                                // Sub-block k's 32 quants (u8) and scale operand.
                                let mut q = [_mm256_setzero_si256(); 8];
                                let mut sc = [_mm256_setzero_si256(); 8];
                                let wd;
                                let mut wdmin = 0f32;
                                let mut mins = _mm_setzero_si128();
                                let mut scales16 = _mm256_setzero_si256();
                                if Q == 0 {
                                    wd = half_at(blk);
                                    wdmin = half_at(blk.add(2));
                                    let packed = std::slice::from_raw_parts(blk.add(4), 12);
                                    let (s, m) = q4k_scales_mins(packed);
                                    mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(
                                        m.as_ptr() as *const __m128i
                                    ));
                                    for j in 0..4 {
                                        let bits =
                                            _mm256_loadu_si256(blk.add(16 + 32 * j) as *const _);
                                        q[2 * j] = _mm256_and_si256(bits, m4);
                                        q[2 * j + 1] =
                                            _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                                        let (lo, hi) = (s[2 * j] as i16, s[2 * j + 1] as i16);
                                        sc[2 * j] = $scale(lo, lo);
                                        sc[2 * j + 1] = $scale(hi, hi);
                                    }
                                } else {
                                    wd = half_at(blk.add(208));
                                    let scales = _mm_loadu_si128(blk.add(192) as *const _);
                                    scales16 = _mm256_cvtepi8_epi16(scales);
                                    for n in 0..2 {
                                        let ql = blk.add(64 * n);
                                        let b1 = _mm256_loadu_si256(ql as *const _);
                                        let b2 = _mm256_loadu_si256(ql.add(32) as *const _);
                                        let h =
                                            _mm256_loadu_si256(blk.add(128 + 32 * n) as *const _);
                                        let h0 = _mm256_slli_epi16(
                                            _mm256_and_si256(h, _mm256_set1_epi8(3)),
                                            4,
                                        );
                                        let h1 = _mm256_slli_epi16(
                                            _mm256_and_si256(h, _mm256_set1_epi8(12)),
                                            2,
                                        );
                                        let h2 = _mm256_and_si256(h, _mm256_set1_epi8(48));
                                        let h3 = _mm256_srli_epi16(
                                            _mm256_and_si256(h, _mm256_set1_epi8(-64)),
                                            2,
                                        );
                                        let lo = |x| _mm256_and_si256(x, m4);
                                        let hi = |x| _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
                                        q[4 * n] = _mm256_or_si256(lo(b1), h0);
                                        q[4 * n + 1] = _mm256_or_si256(lo(b2), h1);
                                        q[4 * n + 2] = _mm256_or_si256(hi(b1), h2);
                                        q[4 * n + 3] = _mm256_or_si256(hi(b2), h3);
                                    }
                                    for (g, sc) in sc.iter_mut().enumerate() {
                                        let lo = *blk.add(192 + 2 * g) as i8 as i16;
                                        let hi = *blk.add(193 + 2 * g) as i8 as i16;
                                        *sc = $scale(lo, hi);
                                    }
                                }
                                for t in 0..NT {
                                    let ab = t * nb + b;
                                    let y = aq.add(ab * QK_K);
                                    let yd = *ad.add(ab);
                                    let bs = _mm256_loadu_si256(bsums.add(16 * ab) as *const _);
                                    let mut sumi = _mm256_setzero_si256();
                                    for k in 0..8 {
                                        let yk = _mm256_loadu_si256(y.add(32 * k) as *const _);
                                        sumi = _mm256_add_epi32(sumi, $sdot(q[k], yk, sc[k]));
                                    }
                                    if Q == 0 {
                                        let s = _mm_hadd_epi16(
                                            _mm256_castsi256_si128(bs),
                                            _mm256_extracti128_si256(bs, 1),
                                        );
                                        let prod = _mm_cvtepi32_ps(_mm_madd_epi16(mins, s));
                                        let dmin = _mm_set1_ps(-yd * wdmin);
                                        acc_m[i][t] = _mm_fmadd_ps(dmin, prod, acc_m[i][t]);
                                    } else {
                                        let sub = _mm256_madd_epi16(bs, scales16);
                                        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(sub, 5));
                                    }
                                    acc[i][t] = _mm256_fmadd_ps(
                                        _mm256_set1_ps(wd * yd),
                                        _mm256_cvtepi32_ps(sumi),
                                        acc[i][t],
                                    );
                                }
                            }
                        }
                    }
                    for i in 0..R {
                        for t in 0..NT {
                            let h = hsum(acc[i][t]);
                            out[i][t] = if Q == 0 { h + hsum4(acc_m[i][t]) } else { h };
                        }
                    }
                }
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scale_avx2(lo: i16, hi: i16) -> __m256i {
        _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
    }

    /// `vpmaddubsw` pairs, then `vpmaddwd` by the scale: `sc · (p0 + p1 + p2 + p3)` per lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sdot_avx2(q: __m256i, y: __m256i, scale: __m256i) -> __m256i {
        _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q, y))
    }

    /// Each i32 lane `(sc, 0)` as two i16: `vpmaddwd` of a lane whose value fits in i16 by
    /// it is `sc · value`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scale_vnni(lo: i16, hi: i16) -> __m256i {
        _mm256_set_m128i(
            _mm_set1_epi32(hi as u16 as i32),
            _mm_set1_epi32(lo as u16 as i32),
        )
    }

    /// `vpdpbusd` (four products per lane, at most 4 · 63 · 127 < 2¹⁵ in magnitude, so the
    /// lane fits in its low i16), then `vpmaddwd` by `(sc, 0)`: `sc · (p0 + p1 + p2 + p3)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    fn sdot_vnni(q: __m256i, y: __m256i, scale: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y), scale)
    }

    /// `sdot_vnni` with `vpdpbusd` done by `vpmaddubsw` + `vpmaddwd` (the same i32 lanes:
    /// nothing saturates), so that the VNNI path's scale handling is tested on CPUs without
    /// AVX-512 VNNI.
    #[cfg(test)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sdot_vnni_on_avx2(q: __m256i, y: __m256i, scale: __m256i) -> __m256i {
        let dpbusd = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), _mm256_set1_epi16(1));
        _mm256_madd_epi16(dpbusd, scale)
    }

    kernels!(avx2, "avx2,fma,f16c", scale_avx2, sdot_avx2);
    #[cfg(test)]
    kernels!(vnni_on_avx2, "avx2,fma,f16c", scale_vnni, sdot_vnni_on_avx2);
    kernels!(
        vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        scale_vnni,
        sdot_vnni
    );

    /// # Safety
    /// The CPU must support `isa`'s features; `o` was built by [`Operands::new`] for `R` rows
    /// and `NT` tokens of a `qt` matrix.
    pub(super) unsafe fn dispatch<const R: usize, const NT: usize>(
        isa: Isa,
        qt: QType,
        o: &Operands,
        out: &mut [[f32; NT]; R],
    ) {
        // SAFETY: by the function's contract.
        unsafe {
            match (isa, qt) {
                (Isa::Avx512Vnni, QType::Q4K) => vnni::gemm::<0, R, NT>(o, out),
                (Isa::Avx512Vnni, _) => vnni::gemm::<1, R, NT>(o, out),
                (_, QType::Q4K) => avx2::gemm::<0, R, NT>(o, out),
                _ => avx2::gemm::<1, R, NT>(o, out),
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::super::format::{quantize_acts, tests::gguf_bytes};
        use super::*;

        #[test]
        fn the_vnni_lane_arithmetic_equals_avx2_bit_for_bit() {
            if super::super::super::isa::detect_isa() == Isa::Scalar {
                eprintln!("no AVX2 on this CPU: nothing to compare");
                return;
            }
            for qt in [QType::Q4K, QType::Q6K] {
                let (rows, cols) = (4, 3 * QK_K);
                let w = QMatrix::from_gguf(qt, rows, cols, &gguf_bytes(qt, rows, cols, 41));
                let w = w.unwrap();
                let x: Vec<f32> = (0..4 * cols)
                    .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 333.0)
                    .collect();
                let a = quantize_acts(&x, cols, ActType::Q8K);
                let o = Operands::new(&w, 0, 4, &a, 0, 4, &(0..3));
                let (mut want, mut got) = ([[0f32; 4]; 4], [[0f32; 4]; 4]);
                // SAFETY: AVX2, FMA and F16C were detected; `o` is for 4 rows and 4 tokens.
                unsafe {
                    if qt == QType::Q4K {
                        avx2::gemm::<0, 4, 4>(&o, &mut want);
                        vnni_on_avx2::gemm::<0, 4, 4>(&o, &mut got);
                    } else {
                        avx2::gemm::<1, 4, 4>(&o, &mut want);
                        vnni_on_avx2::gemm::<1, 4, 4>(&o, &mut got);
                    }
                }
                assert_eq!(format!("{want:?}"), format!("{got:?}"), "{qt:?}");
                assert!(want.iter().flatten().all(|v| v.is_finite() && *v != 0.0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{dequantize_row, q4k_scales_mins, quantize_acts, QType, QK_K};
    use super::*;

    /// Q4_K's unpacking of the 12 packed bytes equals ggml's `get_scale_min_k4`.
    #[test]
    fn q4k_scale_unpacking_matches_get_scale_min_k4() {
        fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
            if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                (
                    (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                )
            }
        }
        let mut state = 0x9e37_79b9u32;
        for _ in 0..200 {
            let packed: Vec<u8> = (0..12)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state as u8
                })
                .collect();
            let (s, m) = q4k_scales_mins(&packed);
            for j in 0..8 {
                assert_eq!((s[j], m[j]), get_scale_min_k4(j, &packed), "{packed:?} {j}");
            }
        }
    }

    #[test]
    fn scalar_reference_is_close_to_dequantize_then_f32() {
        for qt in [QType::Q4K, QType::Q6K] {
            let (rows, cols) = (3, 3 * QK_K);
            let bytes = super::super::format::tests::gguf_bytes(qt, rows, cols, 17);
            let w = QMatrix::from_gguf(qt, rows, cols, &bytes).unwrap();
            let x: Vec<f32> = (0..2 * cols)
                .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 333.0)
                .collect();
            let a = quantize_acts(&x, cols, ActType::Q8K);
            let mut wrow = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(&w, r, &mut wrow);
                // `dmin · m` of each element (Q4_K), for the size of the rounding errors.
                let mut min_term = vec![0f32; cols];
                if qt == QType::Q4K {
                    for (b, blk) in w.row_data(r).chunks(144).enumerate() {
                        let dmin = f16_at(blk, 2);
                        let (_, m) = q4k_scales_mins(&blk[4..16]);
                        for e in 0..QK_K {
                            min_term[b * QK_K + e] = dmin * m[e / 32] as f32;
                        }
                    }
                }
                for t in 0..2 {
                    let got = scalar(qt, w.row_data(r), &a, t, 0..w.blocks()) as f64;
                    let xr = &x[t * cols..(t + 1) * cols];
                    let deq_a = |j: usize| a.qs[t * cols + j] as f64 * a.d[t * 3 + j / QK_K] as f64;
                    let exact: f64 = (0..cols).map(|j| wrow[j] as f64 * deq_a(j)).sum();
                    let f32_ref: f64 = (0..cols).map(|j| (wrow[j] * xr[j]) as f64).sum();
                    let wx: f64 = (0..cols).map(|j| (wrow[j] * xr[j]).abs() as f64).sum();
                    // Both the kernel (`d·d_a`, `dmin·d_a`, the i32 lane sums above 2²⁴, the
                    // fused adds and the final sums) and the dequantization (`d·sc·q − dmin·m`
                    // in f32) round a few times at 2⁻²⁴ relative to the terms
                    // `|d·sc·q| + |dmin·m| ≤ |w| + 2·|dmin·m|` before they cancel, summed over
                    // 768 elements: 1e-5 of `Σ (|w| + 2·|dmin·m|)·|x|` bounds that with a
                    // margin of ~10×.
                    let terms: f64 = (0..cols)
                        .map(|j| ((wrow[j].abs() + 2.0 * min_term[j].abs()) * xr[j].abs()) as f64)
                        .sum();
                    assert!(
                        (got - exact).abs() <= 1e-5 * terms,
                        "{qt:?} {got} vs {exact}"
                    );
                    // Against unquantized activations: Q8_K's rounding, at most half a step
                    // (`amax / 254`) per element, ≲ 1/127 of Σ|w·x| for these activations
                    // (spread evenly up to `amax`).
                    assert!(
                        (got - f32_ref).abs() <= 2e-2 * wx,
                        "{qt:?} {got} vs {f32_ref}"
                    );
                }
            }
        }
    }

    #[test]
    fn candle_agrees_on_a_k_quant_dot_product() {
        // candle's own AVX2 `vec_dot` (its Q8_K rounds halves away from zero, not to even,
        // and its float order differs): a loose check that the formats are read alike.
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        for (qt, g) in [(QType::Q4K, GgmlDType::Q4K), (QType::Q6K, GgmlDType::Q6K)] {
            let (rows, cols) = (4, 2 * QK_K);
            let f: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 170.0)
                .collect();
            let ft = Tensor::from_vec(f, (rows, cols), &Device::Cpu).unwrap();
            let qtensor = QTensor::quantize(&ft, g).unwrap();
            let w = QMatrix::from_gguf(qt, rows, cols, &qtensor.data().unwrap()).unwrap();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
                .collect();
            let want = super::super::format::tests::candle_forward(qtensor, &x, 1);
            let a = quantize_acts(&x, cols, ActType::Q8K);
            let mut wrow = vec![0f32; cols];
            for (r, want) in want.iter().enumerate() {
                let got = scalar(qt, w.row_data(r), &a, 0, 0..w.blocks());
                dequantize_row(&w, r, &mut wrow);
                let wx: f32 = wrow.iter().zip(&x).map(|(w, x)| (w * x).abs()).sum();
                assert!(
                    (got - want).abs() <= 1e-2 * wx,
                    "{qt:?} row {r}: {got} vs {want}"
                );
            }
        }
    }
}
