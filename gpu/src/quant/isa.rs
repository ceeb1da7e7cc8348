//! The instruction sets the quantized kernels run on ([`Isa`], detected once), and the
//! primitives both kernel families (`kernels`: the 32-element formats, `kquants`: Q4_K and
//! Q6_K) share: tile bounds, the prefetch distance and llama.cpp's horizontal sums.

use std::sync::OnceLock;

/// Which instruction set the kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, lane by lane: the reference.
    Scalar,
    /// AVX2 + FMA + F16C (`vpmaddubsw` + `vpmaddwd` for the integer lanes).
    Avx2,
    /// As AVX2, with AVX-512 VNNI's `vpdpbusd` on 256-bit vectors for the integer lanes.
    Avx512Vnni,
}

/// The best path this CPU runs (detected once). `PDSERVE_QUANT_ISA=scalar|avx2|vnni` caps it
/// (for measuring the paths against each other).
pub fn detect_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = best_isa();
        match std::env::var("PDSERVE_QUANT_ISA").as_deref() {
            Ok("scalar") => Isa::Scalar,
            Ok("avx2") if best != Isa::Scalar => Isa::Avx2,
            _ => best,
        }
    })
}

/// Checks, before a SIMD kernel is called, that this CPU has `isa`'s features.
///
/// # Panics
/// When this CPU does not run `isa`.
pub(super) fn assert_supported(isa: Isa) {
    let best = best_isa();
    assert!(isa == Isa::Scalar || isa == best || (isa == Isa::Avx2 && best != Isa::Scalar));
}

fn best_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2 && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return Isa::Avx512Vnni;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// Most activation rows one call of a micro-kernel takes.
pub(crate) const MAX_TOKENS: usize = 4;

/// How far ahead decode's kernel prefetches, in bytes (rounded up to whole groups of rows),
/// into L2: a weight stream from DRAM needs more lines in flight than L1 can track. With
/// 6 KiB into L2 the default model's single-thread GEMVs stream at ~14 GB/s against
/// ~10 GB/s for two groups (2.9–7.7 KiB) into L1 (`gpu/examples/gemv_stream.rs`).
pub(super) const PREFETCH_BYTES: usize = 6 << 10;

/// llama.cpp's `hsum_float_8`: `((x4+x0)+(x6+x2)) + ((x5+x1)+(x7+x3))`.
#[inline]
pub(super) fn hsum8(x: [f32; 8]) -> f32 {
    let r = [x[4] + x[0], x[5] + x[1], x[6] + x[2], x[7] + x[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// x86 helpers of both kernel families.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// The f16 at `p` (little-endian) as f32, by F16C.
    ///
    /// # Safety
    /// `p` points at two readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn half_at(p: *const u8) -> f32 {
        // SAFETY: by the function's contract.
        let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// llama.cpp's `hsum_float_8` on a vector: the eight lanes summed in
    /// [`super::hsum8`]'s order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn hsum(x: __m256) -> f32 {
        let r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
        let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        let r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }
}
