//! GMAC (NIST SP 800-38D: AES-GCM with the message as associated data and no plaintext),
//! computed incrementally so a payload is hashed chunk by chunk while it is hot in cache.
//!
//! `tag = GHASH_H(message ‖ 0-pad ‖ [bits(message)]₆₄ ‖ [0]₆₄) ⊕ AES_K(nonce ‖ 1)` with
//! `H = AES_K(0¹²⁸)`: bit for bit the tag ring's AES-GCM computes for that message as
//! associated data (the tests check it against ring).
//!
//! GHASH runs in one of two implementations, chosen once per key:
//! - **VPCLMULQDQ + AVX-512** (`x86_64`, detected at run time): 32 blocks (512 bytes) per
//!   step, three 512-bit carry-less multiplications (Karatsuba) per 64 bytes and one
//!   reduction per step (aggregated with the precomputed powers H¹…H³²). GHASH is computed
//!   as POLYVAL of the byte-reversed blocks under `mulX(H)` (RFC 8452, appendix A), whose
//!   Montgomery-form product `a·b·x⁻¹²⁸` reduces with two multiplications by
//!   `x⁶³ + x⁶² + x⁵⁷`. On one core of this machine's Zen 4 (same run, load ~3): 24–26 GB/s,
//!   against 8.7 GB/s for ring's whole AES-256-GCM, 5.6 for the `polyval` crate, 3.4 for
//!   `ghash`, 6.5 for keyed BLAKE3 and 1.9 for ring's GMAC (its GHASH of associated data
//!   runs block by block).
//! - elsewhere, the `ghash` crate (RustCrypto; PCLMULQDQ, PMULL or portable).
//!
//! Both are constant time: carry-less multiplications and XORs, no table lookups and no
//! branches on secret data.

use aes::cipher::{Array, BlockCipherEncrypt, KeyInit};
use aes::Aes256;
use ghash::universal_hash::UniversalHash;

/// Bytes of a GHASH block and of a tag.
const BLOCK: usize = 16;

/// Blocks the vector kernel hashes per reduction (and powers of `H` it keeps).
const POWERS: usize = 32;

/// `x¹²⁷ + x¹²⁶ + x¹²¹ + 1`: POLYVAL's modulus without its `x¹²⁸` term.
const POLY_LOW: u128 = 0xc200_0000_0000_0000_0000_0000_0000_0001;

/// `x⁶³ + x⁶² + x⁵⁷`: folds 64 low bits of a product into the bits above them.
const FOLD: u64 = 0xc200_0000_0000_0000;

/// A GMAC key: AES-256 for `H` and the per-message masks, and GHASH's key material.
pub(crate) struct GmacKey {
    aes: Aes256,
    ghash: Ghash,
}

/// GHASH's key, in the form its implementation wants.
enum Ghash {
    /// `mulX(ByteReverse(H))` and its powers in POLYVAL's Montgomery form: `powers[k]` is
    /// the (k+1)-th power.
    #[cfg(target_arch = "x86_64")]
    Avx512 {
        powers: Box<[u128; POWERS]>,
    },
    Portable(ghash::GHash),
}

impl GmacKey {
    /// A key for `key` (32 bytes of AES-256 key).
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        let aes = Aes256::new(&Array::from(*key));
        let mut h = Array::from([0u8; BLOCK]);
        aes.encrypt_block(&mut h);
        #[cfg(target_arch = "x86_64")]
        if avx512_available() {
            let h1 = mulx(u128::from_be_bytes(h.into()));
            let mut powers = [h1; POWERS];
            for k in 1..POWERS {
                powers[k] = dot(powers[k - 1], h1);
            }
            return Self {
                aes,
                ghash: Ghash::Avx512 {
                    powers: Box::new(powers),
                },
            };
        }
        Self {
            aes,
            ghash: Ghash::Portable(ghash::GHash::new(&h)),
        }
    }

    /// Starts the tag of one message under `nonce` (which must never repeat under this key).
    pub(crate) fn start(&self, nonce: &[u8; 12]) -> Gmac {
        let mut j0 = [0u8; BLOCK];
        j0[..12].copy_from_slice(nonce);
        j0[15] = 1;
        let mut mask = Array::from(j0);
        self.aes.encrypt_block(&mut mask);
        let state = match &self.ghash {
            #[cfg(target_arch = "x86_64")]
            Ghash::Avx512 { powers } => State::Avx512 {
                acc: 0,
                powers: **powers,
            },
            Ghash::Portable(g) => State::Portable(g.clone()),
        };
        Gmac {
            state,
            partial: [0; BLOCK],
            partial_len: 0,
            len: 0,
            mask: mask.into(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("vpclmulqdq")
        && std::is_x86_feature_detected!("pclmulqdq")
}

// One per message in progress, on the stack: the copy of the powers is the point (no
// allocation, no borrow), so the size difference is wanted.
#[allow(clippy::large_enum_variant)]
enum State {
    /// The POLYVAL accumulator, and the key's powers (a copy, so that a message in progress
    /// borrows nothing).
    #[cfg(target_arch = "x86_64")]
    Avx512 {
        acc: u128,
        powers: [u128; POWERS],
    },
    Portable(ghash::GHash),
}

/// The tag of one message in progress: feed it with [`Gmac::update`] in any pieces, then
/// [`Gmac::finalize`].
pub(crate) struct Gmac {
    state: State,
    /// Bytes of an incomplete block, hashed once it fills (or zero-padded at the end).
    partial: [u8; BLOCK],
    partial_len: usize,
    /// Bytes of message so far.
    len: u64,
    /// `AES_K(nonce ‖ 1)`.
    mask: [u8; BLOCK],
}

impl Gmac {
    /// Appends `data` to the message.
    pub(crate) fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if self.partial_len > 0 {
            let take = (BLOCK - self.partial_len).min(data.len());
            self.partial[self.partial_len..self.partial_len + take].copy_from_slice(&data[..take]);
            self.partial_len += take;
            data = &data[take..];
            if self.partial_len < BLOCK {
                return;
            }
            let block = self.partial;
            self.blocks(&block);
            self.partial_len = 0;
        }
        let whole = data.len() & !(BLOCK - 1);
        self.blocks(&data[..whole]);
        let rest = &data[whole..];
        self.partial[..rest.len()].copy_from_slice(rest);
        self.partial_len = rest.len();
    }

    /// The tag.
    pub(crate) fn finalize(mut self) -> [u8; BLOCK] {
        if self.partial_len > 0 {
            let mut block = [0u8; BLOCK];
            block[..self.partial_len].copy_from_slice(&self.partial[..self.partial_len]);
            self.blocks(&block);
        }
        let mut lengths = [0u8; BLOCK];
        lengths[..8].copy_from_slice(&(self.len * 8).to_be_bytes());
        self.blocks(&lengths);
        let ghash: [u8; BLOCK] = match self.state {
            #[cfg(target_arch = "x86_64")]
            State::Avx512 { acc, .. } => acc.to_be_bytes(),
            State::Portable(g) => g.finalize().into(),
        };
        std::array::from_fn(|i| ghash[i] ^ self.mask[i])
    }

    /// Hashes whole blocks.
    fn blocks(&mut self, data: &[u8]) {
        debug_assert_eq!(data.len() % BLOCK, 0);
        if data.is_empty() {
            return;
        }
        match &mut self.state {
            #[cfg(target_arch = "x86_64")]
            State::Avx512 { acc, powers } => {
                // SAFETY: `State::Avx512` exists only where `avx512_available()` said so.
                *acc = unsafe { avx512::blocks(powers, *acc, data) };
            }
            State::Portable(g) => g.update_padded(data),
        }
    }
}

/// `v·x` in POLYVAL's field (RFC 8452's `mulX_POLYVAL`), in constant time.
fn mulx(v: u128) -> u128 {
    (v << 1) ^ (POLY_LOW & 0u128.wrapping_sub(v >> 127))
}

/// The 128-bit carry-less product of two 64-bit words, in constant time.
fn clmul64(a: u64, b: u64) -> u128 {
    (0..64).fold(0u128, |r, i| {
        r ^ ((a as u128) << i) & 0u128.wrapping_sub(((b >> i) & 1) as u128)
    })
}

/// POLYVAL's product `a·b·x⁻¹²⁸` (RFC 8452's `dot`): the portable twin of the vector
/// kernel's multiplication, used for the key's powers and in tests.
fn dot(a: u128, b: u128) -> u128 {
    let (a0, a1, b0, b1) = (a as u64, (a >> 64) as u64, b as u64, (b >> 64) as u64);
    let lo = clmul64(a0, b0);
    let hi = clmul64(a1, b1);
    let mi = clmul64(a0, b1) ^ clmul64(a1, b0);
    // Montgomery reduction, 64 bits at a time: adding (low word)·P clears the low word,
    // and dividing by x⁶⁴ moves everything down one word.
    let mi = mi ^ lo.rotate_left(64) ^ clmul64(lo as u64, FOLD);
    hi ^ mi.rotate_left(64) ^ clmul64(mi as u64, FOLD)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{FOLD, POWERS};

    /// POLYVAL of `data` (whole blocks, GHASH byte order) under `powers`, continuing `acc`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW, VPCLMULQDQ and PCLMULQDQ.
    #[target_feature(enable = "avx512f,avx512bw,vpclmulqdq,pclmulqdq")]
    pub(super) unsafe fn blocks(powers: &[u128; POWERS], acc: u128, data: &[u8]) -> u128 {
        // Reverses each 128-bit lane's bytes: GHASH's block order to POLYVAL's.
        let bswap = _mm512_broadcast_i32x4(_mm_set_epi8(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
        ));
        let fold = _mm512_set1_epi64(FOLD as i64);
        // The four powers `first`, `first`-1, … that multiply four consecutive blocks.
        let key = |first: usize| {
            let lanes = [
                powers[first - 1],
                powers[first - 2],
                powers[first - 3],
                powers[first - 4],
            ];
            // SAFETY: reads the 64 bytes of a local array.
            unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) }
        };
        let load = |p: &[u8]| {
            assert!(p.len() >= 64);
            // SAFETY: `p` holds at least 64 bytes.
            _mm512_shuffle_epi8(unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }, bswap)
        };
        let mut acc = _mm512_zextsi128_si512(_mm_set_epi64x((acc >> 64) as i64, acc as i64));
        // 32 blocks per step: block i of the step is multiplied by H³²⁻ⁱ, one reduction.
        let keys: [__m512i; 8] = std::array::from_fn(|j| key(POWERS - 4 * j));
        let mut steps = data.chunks_exact(POWERS * 16);
        for step in &mut steps {
            let mut pairs = [(acc, acc); 8];
            for (j, pair) in pairs.iter_mut().enumerate() {
                *pair = (load(&step[64 * j..]), keys[j]);
            }
            pairs[0].0 = _mm512_xor_si512(pairs[0].0, acc);
            let (lo, mi, hi) = products(&pairs);
            acc = _mm512_zextsi128_si512(sum_lanes(reduce(lo, mi, hi, fold)));
        }
        // The last 0–31 blocks: four at a time, then one at a time.
        let mut rest = steps.remainder();
        while !rest.is_empty() {
            let n = if rest.len() >= 64 { 4 } else { 1 };
            let mut block = [0u8; 64];
            block[..16 * n].copy_from_slice(&rest[..16 * n]);
            let x = _mm512_xor_si512(load(&block), acc);
            // Block i of n is multiplied by Hⁿ⁻ⁱ; lanes past n by zero.
            let mut lanes = [0u128; 4];
            for (i, lane) in lanes.iter_mut().enumerate().take(n) {
                *lane = powers[n - 1 - i];
            }
            // SAFETY: reads the 64 bytes of a local array.
            let k = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
            let (lo, mi, hi) = products(&[(x, k)]);
            acc = _mm512_zextsi128_si512(sum_lanes(reduce(lo, mi, hi, fold)));
            rest = &rest[16 * n..];
        }
        let mut out = [0u128; 1];
        // SAFETY: writes the 16 bytes of a local array.
        unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_castsi512_si128(acc)) };
        out[0]
    }

    /// The unreduced 256-bit products of each pair's lanes, as their low, middle and high
    /// 128 bits (the middle one straddling the other two), summed over the pairs. Karatsuba:
    /// three multiplications per pair, the middle one of the halves' sums.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    #[inline]
    fn products(pairs: &[(__m512i, __m512i)]) -> (__m512i, __m512i, __m512i) {
        let (mut lo, mut mi, mut hi) = (
            _mm512_setzero_si512(),
            _mm512_setzero_si512(),
            _mm512_setzero_si512(),
        );
        for &(x, k) in pairs {
            lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128::<0x00>(x, k));
            hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128::<0x11>(x, k));
            let xs = _mm512_xor_si512(x, _mm512_shuffle_epi32::<_MM_PERM_BADC>(x));
            let ks = _mm512_xor_si512(k, _mm512_shuffle_epi32::<_MM_PERM_BADC>(k));
            mi = _mm512_xor_si512(mi, _mm512_clmulepi64_epi128::<0x00>(xs, ks));
        }
        (lo, _mm512_ternarylogic_epi64::<0x96>(mi, lo, hi), hi)
    }

    /// Each lane's Montgomery reduction (`·x⁻¹²⁸` modulo POLYVAL's polynomial), as `dot`.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    #[inline]
    fn reduce(lo: __m512i, mi: __m512i, hi: __m512i, fold: __m512i) -> __m512i {
        let mi = _mm512_ternarylogic_epi64::<0x96>(
            mi,
            _mm512_shuffle_epi32::<_MM_PERM_BADC>(lo),
            _mm512_clmulepi64_epi128::<0x00>(lo, fold),
        );
        _mm512_ternarylogic_epi64::<0x96>(
            hi,
            _mm512_shuffle_epi32::<_MM_PERM_BADC>(mi),
            _mm512_clmulepi64_epi128::<0x00>(mi, fold),
        )
    }

    /// The XOR of a vector's four 128-bit lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sum_lanes(v: __m512i) -> __m128i {
        let y = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
        _mm_xor_si128(_mm256_castsi256_si128(y), _mm256_extracti128_si256::<1>(y))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

    /// ring's AES-256-GCM tag of `msg` as associated data with no plaintext: GMAC.
    fn ring_gmac(key: &[u8; 32], nonce: [u8; 12], msg: &[u8]) -> [u8; 16] {
        let k = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).unwrap());
        let tag = k
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(msg),
                &mut [],
            )
            .unwrap();
        tag.as_ref().try_into().unwrap()
    }

    fn message(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn keys(raw: &[u8; 32]) -> Vec<GmacKey> {
        let mut out = vec![GmacKey::new(raw)];
        let aes = Aes256::new(&Array::from(*raw));
        let mut h = Array::from([0u8; BLOCK]);
        aes.encrypt_block(&mut h);
        out.push(GmacKey {
            aes,
            ghash: Ghash::Portable(ghash::GHash::new(&h)),
        });
        out
    }

    #[test]
    fn matches_ring_gmac_at_every_length_and_split() {
        let raw: [u8; 32] = std::array::from_fn(|i| i as u8 * 7 + 1);
        let keys = keys(&raw);
        #[cfg(target_arch = "x86_64")]
        if avx512_available() {
            assert!(matches!(keys[0].ghash, Ghash::Avx512 { .. }));
        }
        let lens = (0..600).chain([4095, 4096, 4097, 65536 + 48, (1 << 20) + 5]);
        for len in lens {
            let msg = message(len, len as u64);
            let nonce: [u8; 12] = std::array::from_fn(|i| (len + i) as u8);
            let want = ring_gmac(&raw, nonce, &msg);
            for key in &keys {
                let mut whole = key.start(&nonce);
                whole.update(&msg);
                assert_eq!(whole.finalize(), want, "len {len}");
                // Pieces of awkward sizes give the same tag.
                let mut pieces = key.start(&nonce);
                let mut rest = &msg[..];
                let mut step = 1;
                while !rest.is_empty() {
                    let n = step.min(rest.len());
                    pieces.update(&rest[..n]);
                    rest = &rest[n..];
                    step = step * 3 % 1031 + 1;
                }
                assert_eq!(pieces.finalize(), want, "len {len} in pieces");
            }
        }
    }

    #[test]
    fn nist_gcm_test_case_13() {
        // AES-256, zero key, zero IV, no plaintext (McGrew & Viega's GCM test case 13): the tag of the empty message is AES_K(IV ‖ 1).
        let key = GmacKey::new(&[0; 32]);
        let tag = key.start(&[0; 12]).finalize();
        assert_eq!(
            tag,
            [
                0x53, 0x0f, 0x8a, 0xfb, 0xc7, 0x45, 0x36, 0xb9, 0xa9, 0x63, 0xb4, 0xf1, 0xc4, 0xcb,
                0x73, 0x8b
            ]
        );
    }

    #[test]
    fn dot_is_polyval_multiplication() {
        // RFC 8452 appendix A: POLYVAL(H, X) = dot(X, H) for one block.
        let h = u128::from_le_bytes([
            0x25, 0x62, 0x93, 0x47, 0x58, 0x92, 0x42, 0x76, 0x1d, 0x31, 0xf8, 0x26, 0xba, 0x4b,
            0x75, 0x7b,
        ]);
        let x = u128::from_le_bytes([
            0x4f, 0x4f, 0x95, 0x66, 0x8c, 0x83, 0xdf, 0xb6, 0x40, 0x17, 0x62, 0xbb, 0x2d, 0x01,
            0xa2, 0x62,
        ]);
        let x2 = u128::from_le_bytes([
            0xd1, 0xa2, 0x4d, 0xdd, 0x27, 0x21, 0xd0, 0x06, 0xbb, 0xe4, 0x5f, 0x20, 0xd3, 0xc9,
            0xf3, 0x62,
        ]);
        let want = u128::from_le_bytes([
            0xf7, 0xa3, 0xb4, 0x7b, 0x84, 0x61, 0x19, 0xfa, 0xe5, 0xb7, 0x86, 0x6c, 0xf5, 0xe5,
            0xb7, 0x7e,
        ]);
        assert_eq!(dot(dot(x, h) ^ x2, h), want);
    }
}
