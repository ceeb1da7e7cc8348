//! The forward pass's elementwise math as llama.cpp's CPU backend does it: `exp` by ggml's
//! vectorised `ggml_v_expf` (its AVX2 form, adapted there from ARM's optimized-routines: at
//! most 1.45 ulp + 0.5 from the true value), used by [`softmax`] and [`swiglu`].
//!
//! One formula on every path: eight lanes with AVX2 and FMA, one value at a time otherwise,
//! with the same fused and plain operations in the same order. A value's bits therefore do not
//! depend on where it sits in a row (a row's tail takes the scalar path) or on the CPU, so
//! prefill, decode and any batch composition agree. Per value it costs a few vector
//! instructions against ~20 ns for libm's scalar `expf` (which took ~4 % of a prefill).

/// `0x1.8p23`: adding it rounds to an integer in the low mantissa bits.
const ROUND: u32 = 0x4b40_0000;
/// `0x1.715476p+0` (log2 e).
const LOG2E: u32 = 0x3fb8_aa3b;
/// `0x1.62e4p-1` and `0x1.7f7d1cp-20`: ln 2 in two parts.
const LN2_HI: u32 = 0x3f31_7200;
const LN2_LO: u32 = 0x35bf_be8e;
/// The polynomial's coefficients, highest degree first: `0x1.0e4020p-7`, `0x1.573e2ep-5`,
/// `0x1.555e66p-3`, `0x1.fffdb6p-2`, `0x1.ffffecp-1`.
const P: [u32; 5] = [
    0x3c07_2010,
    0x3d2b_9f17,
    0x3e2a_af33,
    0x3eff_fedb,
    0x3f7f_fff6,
];

#[inline(always)]
fn c(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// `eˣ` by ggml's formula (see the module docs): `+∞` above ~88.38, `0` below ~−103.97,
/// NaN for NaN.
#[inline]
pub fn exp(x: f32) -> f32 {
    let z = x.mul_add(c(LOG2E), c(ROUND));
    let n = z - c(ROUND);
    let b = (-n).mul_add(c(LN2_LO), (-n).mul_add(c(LN2_HI), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(P[0])
        .mul_add(b, c(P[1]))
        .mul_add(u, c(P[2]).mul_add(b, c(P[3])))
        .mul_add(u, c(P[4]) * b);
    if n.abs() <= 126.0 || n.is_nan() {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

/// `x / (1 + e⁻ˣ)`, as ggml's `ggml_v_silu`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `out = silu(gate) · up`, elementwise (ggml's `ggml_vec_swiglu_f32`: the gated FFN's
/// activation).
///
/// # Panics
/// When the three lengths differ.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present (checked above).
        i = unsafe { x86::swiglu(gate, up, out) };
    }
    for ((o, &g), &u) in out[i..].iter_mut().zip(&gate[i..]).zip(&up[i..]) {
        *o = silu(g) * u;
    }
}

/// Softmax of `row` in place, as ggml's `soft_max` computes it: `y = exp(x − max)`, their sum
/// in f64 (each eight values added in f32 first, as its AVX2 path does, the tail one by one),
/// then every `y` times `(1 / sum) as f32`.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = exp_shifted(row, max);
    let inv = (1.0 / sum) as f32;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// `row[i] = exp(row[i] − max)` in place; returns their sum in f64 ([`softmax`]'s operations
/// and order, without the normalisation).
pub fn exp_shifted(row: &mut [f32], max: f32) -> f64 {
    let mut sum = 0f64;
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present (checked above).
        (i, sum) = unsafe { x86::exp_sub_sum(row, max) };
    }
    while i + 8 <= row.len() {
        let mut v = [0f32; 8];
        for (v, x) in v.iter_mut().zip(&mut row[i..i + 8]) {
            *x = exp(*x - max);
            *v = *x;
        }
        sum += f64::from(sum8(&v));
        i += 8;
    }
    for x in &mut row[i..] {
        *x = exp(*x - max);
        sum += f64::from(*x);
    }
    sum
}

/// Eight values added as ggml's AVX2 softmax adds a vector: high half onto low, then pairs.
#[inline]
fn sum8(v: &[f32; 8]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|i| v[4 + i] + v[i]);
    (h[0] + h[2]) + (h[1] + h[3])
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{c, sum8, LN2_HI, LN2_LO, LOG2E, P, ROUND};
    use std::arch::x86_64::*;

    /// [`super::exp`] on eight lanes, the same operations.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let set = |b: u32| _mm256_set1_ps(c(b));
        let r = set(ROUND);
        let z = _mm256_fmadd_ps(x, set(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, set(LN2_LO), _mm256_fnmadd_ps(n, set(LN2_HI), x));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            e,
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(set(P[0]), b, set(P[1])),
                u,
                _mm256_fmadd_ps(set(P[2]), b, set(P[3])),
            ),
            u,
            _mm256_mul_ps(set(P[4]), b),
        );
        if _mm256_movemask_ps(big) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let huge = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
        let scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
        let normal = _mm256_fmadd_ps(k, j, k);
        _mm256_blendv_ps(
            _mm256_blendv_ps(normal, scaled, big),
            _mm256_mul_ps(s1, s1),
            huge,
        )
    }

    /// Whole groups of eight of [`super::swiglu`]; returns how many values it did.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; the slices are equally long.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let n = out.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n <= len` of all three slices.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
            }
        }
        n
    }

    /// `row[i] = exp(row[i] − max)` for whole groups of eight; returns how many values it did
    /// and their sum ([`super::softmax`]'s order).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> (usize, f64) {
        let n = row.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        let mut sum = 0f64;
        for i in (0..n).step_by(8) {
            let mut v = [0f32; 8];
            // SAFETY: `i + 8 <= n <= row.len()`.
            unsafe {
                let p = row.as_mut_ptr().add(i);
                let y = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                _mm256_storeu_ps(p, y);
                _mm256_storeu_ps(v.as_mut_ptr(), y);
            }
            sum += f64::from(sum8(&v));
        }
        (n, sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs across the whole range, the edges of both special paths, and non-finite values.
    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.061).collect();
        v.extend((0..1000).map(|i| -104.0 + i as f32 * 0.017));
        v.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            87.3,
            88.37,
            88.4,
            89.0,
            -87.3,
            -88.0,
            -103.9,
            -104.0,
            -150.0,
            500.0,
            -500.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
        ]);
        v
    }

    #[test]
    fn exp_is_close_to_libm_and_exact_at_the_edges() {
        for x in inputs() {
            let (got, want) = (exp(x), x.exp());
            let ulp = f32::from_bits(want.to_bits() + 1) - want;
            if (-87.0..=88.0).contains(&x) {
                assert!(
                    (got - want).abs() <= 2.0 * ulp,
                    "exp({x}) = {got}, libm {want}"
                );
            } else if x > 88.0 {
                // ggml flushes to +∞ from ~88.38 (libm from ~88.72).
                assert!(
                    got == f32::INFINITY || (got - want).abs() <= 2.0 * ulp,
                    "exp({x}) = {got}"
                );
                assert!(want.is_finite() || got == f32::INFINITY, "exp({x}) = {got}");
            } else {
                // Subnormal results (to 0 below ~−103.97): a few of the smallest steps off.
                assert!((got - want).abs() <= 1e-44, "exp({x}) = {got}, libm {want}");
            }
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn eight_lanes_give_the_scalar_bits() {
        if !avx2() {
            return;
        }
        let mut xs = inputs();
        xs.push(f32::NAN);
        while !xs.len().is_multiple_of(8) {
            xs.push(1.5);
        }
        // Mixed groups too: a special value beside ordinary ones takes the blend path.
        xs.rotate_left(3);
        for g in xs.chunks(8) {
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and FMA are present (checked above); eight floats each.
            unsafe {
                use std::arch::x86_64::*;
                let y = x86::exp8(_mm256_loadu_ps(g.as_ptr()));
                _mm256_storeu_ps(got.as_mut_ptr(), y);
            }
            for (x, y) in g.iter().zip(got) {
                let want = exp(*x);
                assert!(
                    y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()),
                    "exp({x}): lanes {y} scalar {want}"
                );
            }
        }
    }

    #[test]
    fn softmax_and_swiglu_do_not_depend_on_position_or_path() {
        // A row's values get the same bits whatever its length (SIMD groups or the tail).
        let xs: Vec<f32> = (0..37)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
            .collect();
        let mut whole = xs.clone();
        softmax(&mut whole);
        let sum: f32 = whole.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "{sum}");
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut reference: Vec<f64> = xs.iter().map(|&x| f64::from(x - max).exp()).collect();
        let s: f64 = reference.iter().sum();
        reference.iter_mut().for_each(|v| *v /= s);
        for (got, want) in whole.iter().zip(&reference) {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-6 * want.max(1e-3),
                "{got} {want}"
            );
        }
        let up: Vec<f32> = (0..37).map(|i| i as f32 * 0.1 - 1.0).collect();
        let mut out = vec![0f32; 37];
        swiglu(&xs, &up, &mut out);
        for i in 0..37 {
            let mut one = [0f32];
            swiglu(&xs[i..i + 1], &up[i..i + 1], &mut one);
            assert_eq!(out[i].to_bits(), one[0].to_bits(), "value {i}");
            let want = f64::from(xs[i]) / (1.0 + (-f64::from(xs[i])).exp()) * f64::from(up[i]);
            assert!((f64::from(out[i]) - want).abs() <= 1e-6 * want.abs().max(1e-3));
        }
        // Large negative and positive gates: silu → −0 / x, no NaN from ∞/∞.
        let mut out = [0f32; 2];
        swiglu(&[-200.0, 200.0], &[1.0, 1.0], &mut out);
        assert_eq!(out, [-0.0, 200.0]);
    }
}
