//! Block formats: weights (Q4_0, Q4_1, Q8_0 in a per-row structure of arrays; Q4_K, Q6_K in
//! GGUF's own super-blocks), activations quantized per row to Q8_0 / Q8_1 / Q8_K.

use half::f16;
use std::mem::MaybeUninit;
use std::sync::Mutex;

/// Elements per quantization block of Q4_0, Q4_1, Q8_0 and their activations.
pub const QK: usize = 32;

/// Elements per super-block of the k-quants (Q4_K, Q6_K) and their activations (Q8_K).
pub const QK_K: usize = 256;

/// A weight block format this module runs natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    /// `d: f16, qs: [u8; 16]`, value `(q − 8) · d` (low nibbles are elements 0..16).
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`, value `q · d + m`.
    Q4_1,
    /// `d: f16, qs: [i8; 32]`, value `q · d`.
    Q8_0,
    /// 256-element super-block `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: eight
    /// 32-element sub-blocks with 6-bit scales `sc` and minimums `m` packed in `scales`, value
    /// `d · sc · q − dmin · m` (sub-blocks 2j and 2j+1 are the low and high nibbles of
    /// `qs[32j..32j + 32]`).
    Q4K,
    /// 256-element super-block `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`:
    /// sixteen 16-element sub-blocks with 8-bit scales, 6-bit quants, value `d · sc · (q − 32)`.
    Q6K,
}

impl QType {
    /// Bytes of one GGUF block.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q8_0 => 34,
            QType::Q4K => 144,
            QType::Q6K => 210,
        }
    }

    /// Elements per block: [`QK`], or [`QK_K`] for the k-quants.
    pub fn block_elems(self) -> usize {
        if self.is_k_quant() {
            QK_K
        } else {
            QK
        }
    }

    /// Whether this is a 256-element super-block format (Q4_K, Q6_K).
    pub fn is_k_quant(self) -> bool {
        matches!(self, QType::Q4K | QType::Q6K)
    }

    /// Bytes of quants in one block (Q6_K: `ql` and `qh`).
    pub fn quant_bytes(self) -> usize {
        match self {
            QType::Q4_0 | QType::Q4_1 => 16,
            QType::Q8_0 => 32,
            QType::Q4K => 128,
            QType::Q6K => 192,
        }
    }

    /// The activation format llama.cpp pairs with this weight format (`vec_dot_type`).
    pub fn act_type(self) -> ActType {
        match self {
            QType::Q4_1 => ActType::Q8_1,
            QType::Q4_0 | QType::Q8_0 => ActType::Q8_0,
            QType::Q4K | QType::Q6K => ActType::Q8K,
        }
    }

    /// From candle's dtype tag, for the types this module runs.
    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        match dtype {
            G::Q4_0 => Some(QType::Q4_0),
            G::Q4_1 => Some(QType::Q4_1),
            G::Q8_0 => Some(QType::Q8_0),
            G::Q4K => Some(QType::Q4K),
            G::Q6K => Some(QType::Q6K),
            _ => None,
        }
    }
}

/// Weight rows that share one interleaved array of scales (see [`QMatrix`]).
pub(crate) const ROW_GROUP: usize = 4;

/// A quantized weight matrix `[rows, cols]`. Q4_0 / Q4_1 / Q8_0 rows are stored in groups of
/// [`ROW_GROUP`] rows (the last group padded with zero rows): the quants of each of the four
/// rows (`blocks × quant_bytes` each, one row after the other), then the group's f16 scales
/// interleaved by block (`d` of block 0 for rows 0‥3, of block 1 for rows 0‥3, …), then (Q4_1)
/// its f16 minimums the same way. Decode's kernel, which runs the four rows of a group
/// together, turns a block's four scales into floats with one instruction. A k-quant row keeps
/// GGUF's own array of super-blocks (a super-block is 144 or 210 bytes, read whole by a
/// kernel, so there is nothing to gain by splitting it).
#[derive(Clone, Debug)]
pub struct QMatrix {
    qtype: QType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl QMatrix {
    /// Rebuilds GGUF's row-major array of blocks (`rows · cols / block_elems` blocks) into the
    /// grouped layout (the same values). Returns `None` when `cols` is not a whole number of
    /// blocks (for the k-quants: of 256-element super-blocks) or the byte count does not match.
    pub fn from_gguf(qtype: QType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let be = qtype.block_elems();
        if !cols.is_multiple_of(be) || bytes.len() != rows * cols / be * qtype.block_bytes() {
            return None;
        }
        if qtype.is_k_quant() {
            return Some(Self {
                qtype,
                rows,
                cols,
                data: bytes.to_vec(),
            });
        }
        let nb = cols / QK;
        let (bb, qb) = (qtype.block_bytes(), qtype.quant_bytes());
        let mut w = Self {
            qtype,
            rows,
            cols,
            data: vec![0u8; rows.div_ceil(ROW_GROUP) * ROW_GROUP * nb * bb],
        };
        for r in 0..rows {
            let src = &bytes[r * nb * bb..(r + 1) * nb * bb];
            let at = w.layout(r);
            for b in 0..nb {
                let blk = &src[b * bb..(b + 1) * bb];
                w.data[at.d + 8 * b..at.d + 8 * b + 2].copy_from_slice(&blk[0..2]);
                let q0 = match qtype {
                    QType::Q4_1 => {
                        w.data[at.m + 8 * b..at.m + 8 * b + 2].copy_from_slice(&blk[2..4]);
                        4
                    }
                    _ => 2,
                };
                w.data[at.qs + b * qb..at.qs + (b + 1) * qb].copy_from_slice(&blk[q0..q0 + qb]);
            }
        }
        Some(w)
    }

    /// Where row `r`'s quants start, and its scale and minimum of block 0 (block `b`'s are
    /// `8 · b` bytes further on: four rows' f16 per block).
    fn layout(&self, r: usize) -> RowLayout {
        let nb = self.blocks();
        let qb = self.qtype.quant_bytes();
        let (g, lane) = (r / ROW_GROUP, r % ROW_GROUP);
        let group = g * self.group_bytes();
        let d = group + ROW_GROUP * nb * qb + 2 * lane;
        RowLayout {
            qs: group + lane * nb * qb,
            d,
            m: d + ROW_GROUP * nb * 2,
        }
    }

    /// The block format.
    pub fn qtype(&self) -> QType {
        self.qtype
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the weights take (what a decode step streams).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Blocks per row (super-blocks for the k-quants).
    pub fn blocks(&self) -> usize {
        self.cols / self.qtype.block_elems()
    }

    /// Bytes of one k-quant row.
    pub(crate) fn row_bytes(&self) -> usize {
        debug_assert!(self.qtype.is_k_quant());
        self.blocks() * self.qtype.block_bytes()
    }

    /// Bytes of one group of [`ROW_GROUP`] Q4_0 / Q4_1 / Q8_0 rows.
    pub(crate) fn group_bytes(&self) -> usize {
        ROW_GROUP * self.blocks() * self.qtype.block_bytes()
    }

    /// Row `r`'s super-blocks (k-quants).
    #[inline]
    pub(crate) fn row_data(&self, r: usize) -> &[u8] {
        debug_assert!(self.qtype.is_k_quant());
        &self.data[r * self.row_bytes()..(r + 1) * self.row_bytes()]
    }

    /// The `n` groups of rows from `r0` (a multiple of [`ROW_GROUP`]; the groups' rows all
    /// below [`rows`](Self::rows)): their bytes, group after group (see [`QMatrix`]).
    #[inline]
    pub(crate) fn groups(&self, r0: usize, n: usize) -> &[u8] {
        assert!(r0.is_multiple_of(ROW_GROUP) && r0 + n * ROW_GROUP <= self.rows);
        assert!(!self.qtype.is_k_quant());
        let gb = self.group_bytes();
        &self.data[r0 / ROW_GROUP * gb..(r0 / ROW_GROUP + n) * gb]
    }

    /// Row `r`'s quants, scales and minimums (empty unless Q4_1).
    #[inline]
    pub(crate) fn row(&self, r: usize) -> RowRef<'_> {
        assert!(r < self.rows && !self.qtype.is_k_quant());
        let nb = self.blocks();
        let at = self.layout(r);
        let scales = 8 * (nb - 1) + 2;
        RowRef {
            qs: &self.data[at.qs..at.qs + nb * self.qtype.quant_bytes()],
            d: &self.data[at.d..at.d + scales],
            m: if self.qtype == QType::Q4_1 {
                &self.data[at.m..at.m + scales]
            } else {
                &[]
            },
        }
    }
}

/// Byte offsets of one row's arrays in [`QMatrix`]'s data.
struct RowLayout {
    qs: usize,
    d: usize,
    m: usize,
}

/// One weight row's arrays.
#[derive(Clone, Copy)]
pub(crate) struct RowRef<'a> {
    pub qs: &'a [u8],
    /// f16 scales, little-endian bytes, block `b`'s at `8 · b` (the group's rows interleaved).
    pub d: &'a [u8],
    /// f16 minimums (Q4_1), as `d`.
    pub m: &'a [u8],
}

impl RowRef<'_> {
    #[inline]
    pub fn d(&self, b: usize) -> f32 {
        f16::from_le_bytes([self.d[8 * b], self.d[8 * b + 1]]).to_f32()
    }
    #[inline]
    pub fn m(&self, b: usize) -> f32 {
        f16::from_le_bytes([self.m[8 * b], self.m[8 * b + 1]]).to_f32()
    }
}

/// Q4_K's eight 6-bit scales and eight 6-bit minimums from its 12 packed bytes, unpacked as
/// llama.cpp's AVX2 `ggml_vec_dot_q4_K_q8_K` does (the same values as `get_scale_min_k4`).
#[inline]
pub(crate) fn q4k_scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let word = |i: usize| u32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap());
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let u3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let scales =
        ((u0 & KMASK1) as u64) | (((u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4)) as u64) << 32;
    let mins = ((u1 & KMASK1) as u64) | (u3 as u64) << 32;
    (scales.to_le_bytes(), mins.to_le_bytes())
}

/// Row `r` of a weight matrix as f32 (embedding lookups, tests). The k-quants are expanded
/// with llama.cpp's `dequantize_row_q4_K` / `dequantize_row_q6_K` float operations.
pub fn dequantize_row(w: &QMatrix, r: usize, out: &mut [f32]) {
    match w.qtype {
        QType::Q4K => return dequantize_q4k(w.row_data(r), out),
        QType::Q6K => return dequantize_q6k(w.row_data(r), out),
        _ => {}
    }
    let row = w.row(r);
    for b in 0..w.blocks() {
        let d = row.d(b);
        let o = &mut out[b * QK..(b + 1) * QK];
        match w.qtype {
            QType::Q8_0 => {
                for (j, o) in o.iter_mut().enumerate() {
                    *o = row.qs[b * 32 + j] as i8 as f32 * d;
                }
            }
            QType::Q4_0 | QType::Q4_1 => {
                let qs = &row.qs[b * 16..b * 16 + 16];
                let (m, off) = match w.qtype {
                    QType::Q4_1 => (row.m(b), 0i32),
                    _ => (0.0, 8),
                };
                for j in 0..16 {
                    let lo = (qs[j] & 0x0f) as i32 - off;
                    let hi = (qs[j] >> 4) as i32 - off;
                    o[j] = lo as f32 * d + m;
                    o[j + 16] = hi as f32 * d + m;
                }
            }
            QType::Q4K | QType::Q6K => unreachable!("handled above"),
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn dequantize_q4k(row: &[u8], out: &mut [f32]) {
    for (blk, y) in row.chunks_exact(144).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (sc, mn) = q4k_scales_mins(&blk[4..16]);
        for j in 0..4 {
            let qs = &blk[16 + 32 * j..16 + 32 * j + 32];
            let (d1, m1) = (d * sc[2 * j] as f32, dmin * mn[2 * j] as f32);
            let (d2, m2) = (d * sc[2 * j + 1] as f32, dmin * mn[2 * j + 1] as f32);
            for (l, &q) in qs.iter().enumerate() {
                y[64 * j + l] = d1 * (q & 0x0f) as f32 - m1;
                y[64 * j + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// Q6_K super-block element `e`'s 6-bit quant (0..64), from `ql` (128 bytes) and `qh` (64).
#[inline]
pub(crate) fn q6k_quant(ql: &[u8], qh: &[u8], e: usize) -> u8 {
    let (half, group, l) = (e / 128, e % 128 / 32, e % 32);
    let lo = ql[64 * half + 32 * (group & 1) + l] >> (4 * (group >> 1)) & 0x0f;
    let hi = qh[32 * half + l] >> (2 * group) & 3;
    lo | hi << 4
}

fn dequantize_q6k(row: &[u8], out: &mut [f32]) {
    for (blk, y) in row.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let (ql, qh) = (&blk[..128], &blk[128..192]);
        let d = f16_at(blk, 208);
        for (e, y) in y.iter_mut().enumerate() {
            let sc = blk[192 + e / 16] as i8;
            *y = d * sc as f32 * (q6k_quant(ql, qh, e) as i32 - 32) as f32;
        }
    }
}

/// Activation block formats (`vec_dot_type`s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActType {
    /// `d`, 32 × i8.
    Q8_0,
    /// `d`, `s = d · Σq`, 32 × i8.
    Q8_1,
    /// 256-element super-block: `d` (f32), 256 × i8, and `bsums`: the sums of each 16 quants.
    Q8K,
}

impl ActType {
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            ActType::Q8K => QK_K,
            ActType::Q8_0 | ActType::Q8_1 => QK,
        }
    }
}

/// Token rows of activations quantized to [`ActType`]: per block a scale `d` (Q8_0, Q8_1:
/// already rounded through f16 as llama.cpp stores it), (Q8_1) the sum term `s`, (Q8_K) the
/// 16 `bsums`, and the quants.
#[derive(Clone, Debug)]
pub struct QActs {
    act: ActType,
    cols: usize,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
    pub(crate) bsums: Vec<i16>,
    pub(crate) qs: Vec<i8>,
}

impl QActs {
    /// Token rows.
    pub fn rows(&self) -> usize {
        self.qs.len() / self.cols.max(1)
    }
    /// The format.
    pub fn act_type(&self) -> ActType {
        self.act
    }
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / self.act.block_elems()
    }
}

/// Blocks of activations one compute-pool item quantizes.
const ITEM_BLOCKS: usize = 256;

/// Q8_0 / Q8_1 quantization of whole blocks (`d`, `s` and `qs` sized for `x`'s blocks; `s`
/// is left as it is for Q8_0): eight lanes at a time as llama.cpp's AVX2 quantizer where the
/// CPU has AVX2, else [`quantize_blocks_scalar`]; the same bits either way.
fn quantize_blocks(
    x: &[f32],
    act: ActType,
    d: &mut [f32],
    s: &mut [f32],
    qs: &mut [MaybeUninit<i8>],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above).
        return unsafe { quantize_blocks_avx2(x, act, d, s, qs) };
    }
    quantize_blocks_scalar(x, act, d, s, qs)
}

/// [`quantize_blocks`] on eight lanes: per block the largest magnitude, `q = round_half_even(x
/// · id)` converted to i32 (the same values the scalar path clamps: `|x · id| ≤ 127` up to
/// rounding), their integer sum, and the quants packed to bytes with saturation. It profiled
/// at ~4 % of a prefill in the auto-vectorised form.
///
/// # Safety
/// The CPU has AVX2; the slices are sized as [`quantize_blocks`] says.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(
    x: &[f32],
    act: ActType,
    d: &mut [f32],
    s: &mut [f32],
    qs: &mut [MaybeUninit<i8>],
) {
    use std::arch::x86_64::*;
    let nb = x.len() / QK;
    assert!(d.len() >= nb && s.len() >= nb && qs.len() >= nb * QK);
    let sign = _mm256_set1_ps(-0.0);
    // Packing interleaves 128-bit lanes; this puts the 32 bytes back in element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        // SAFETY: block `b`'s 32 floats and 32 quants are inside `x` and `qs` (asserted).
        unsafe {
            let p = x.as_ptr().add(b * QK);
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            let db = amax / 127.0;
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let q = v.map(|v| {
                _mm256_cvtps_epi32(_mm256_round_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(_mm256_mul_ps(v, id)))
            });
            let total =
                _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let t4 = _mm_add_epi32(
                _mm256_extracti128_si256::<1>(total),
                _mm256_castsi256_si128(total),
            );
            let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2)));
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let bytes = _mm256_permutevar8x32_epi32(bytes, order);
            _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK) as *mut __m256i, bytes);
            d[b] = f16::from_f32(db).to_f32();
            if act == ActType::Q8_1 {
                s[b] = f16::from_f32(db * sum as f32).to_f32();
            }
        }
    }
}

/// [`quantize_blocks`] one value at a time (other CPUs; the reference of the AVX2 path).
fn quantize_blocks_scalar(
    x: &[f32],
    act: ActType,
    d: &mut [f32],
    s: &mut [f32],
    qs: &mut [MaybeUninit<i8>],
) {
    for (((blk, q), d), s) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(d)
        .zip(s)
    {
        let amax = abs_max(blk);
        let db = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in q.iter_mut().zip(blk) {
            let r = (v * id).round_ties_even() as i32;
            let r = r.clamp(-128, 127);
            sum += r;
            q.write(r as i8);
        }
        *d = f16::from_f32(db).to_f32();
        if act == ActType::Q8_1 {
            *s = f16::from_f32(db * sum as f32).to_f32();
        }
    }
}

/// The largest `|v|` of a block, in eight independent lanes so that it compiles to vector
/// maxima (`f32::max`'s NaN rule kept the fold scalar; a maximum is exact in any order).
#[inline]
fn abs_max(blk: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for part in blk.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(part) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    lanes.into_iter().fold(0f32, f32::max)
}

/// Quantizes `x` (`rows × cols`, row-major; `cols` a whole number of blocks) block by block as
/// llama.cpp's AVX2 `quantize_row_q8_0` / `quantize_row_q8_1` do: `amax = max |x|`,
/// `d = amax / 127`, `q = round_half_even(x · (127 / amax))`, `s = d · Σq`, with `d` and `s`
/// stored as f16. Q8_K follows llama.cpp's `quantize_row_q8_K_ref` (what its x86 build
/// runs): per 256 elements `iscale = −127 / max` (`max` the first element of largest
/// magnitude), `q = min(127, round_half_even(iscale · x))`, `d = 1 / iscale` kept in f32, and
/// `bsums` the sums of each 16 quants.
///
/// # Panics
/// When `cols` is not a multiple of the block size or `x.len()` of `cols`.
pub fn quantize_acts(x: &[f32], cols: usize, act: ActType) -> QActs {
    assert!(cols.is_multiple_of(act.block_elems()) && x.len().is_multiple_of(cols.max(1)));
    if act == ActType::Q8K {
        return quantize_q8k(x, cols);
    }
    let nblocks = x.len() / QK;
    let mut d = vec![0f32; nblocks];
    let mut s = vec![0f32; nblocks];
    // Written block by block below before its length is set (a prefill's zeroing of it was
    // a serial `memset` beside the pool's work).
    let mut qs: Vec<i8> = Vec::with_capacity(x.len());
    let spare = &mut qs.spare_capacity_mut()[..x.len()];
    if nblocks <= ITEM_BLOCKS {
        quantize_blocks(x, act, &mut d, &mut s, spare);
    } else {
        // Blocks are independent: a prefill's rows are quantized on the compute pool.
        type Part<'a> = (
            &'a [f32],
            &'a mut [f32],
            &'a mut [f32],
            &'a mut [MaybeUninit<i8>],
        );
        let parts: Vec<Mutex<Part<'_>>> = x
            .chunks(ITEM_BLOCKS * QK)
            .zip(d.chunks_mut(ITEM_BLOCKS))
            .zip(s.chunks_mut(ITEM_BLOCKS))
            .zip(spare.chunks_mut(ITEM_BLOCKS * QK))
            .map(|(((x, d), s), q)| Mutex::new((x, d, s, q)))
            .collect();
        super::pool::global().run(parts.len(), &|k| {
            let mut part = parts[k].lock().expect("each part is run once");
            let (x, d, s, q) = &mut *part;
            quantize_blocks(x, act, d, s, q);
        });
    }
    // SAFETY: every block's 32 quants were written above (`x` is whole blocks; a panic in a
    // pool item panics in `run`, before this).
    unsafe { qs.set_len(x.len()) };
    if act != ActType::Q8_1 {
        s = Vec::new();
    }
    QActs {
        act,
        cols,
        d,
        s,
        bsums: Vec::new(),
        qs,
    }
}

/// Q8_K as [`quantize_acts`] describes it; an all-zero super-block is all zeros.
fn quantize_q8k(x: &[f32], cols: usize) -> QActs {
    let nblocks = x.len() / QK_K;
    let mut d = Vec::with_capacity(nblocks);
    let mut bsums = Vec::with_capacity(nblocks * QK_K / 16);
    let mut qs = vec![0i8; x.len()];
    for (blk, q) in x.chunks_exact(QK_K).zip(qs.chunks_exact_mut(QK_K)) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in blk {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        if amax == 0.0 {
            d.push(0.0);
            bsums.extend([0i16; QK_K / 16]);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in q.iter_mut().zip(blk) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        bsums.extend(
            q.chunks_exact(16)
                .map(|g| g.iter().map(|&q| q as i16).sum::<i16>()),
        );
        d.push(1.0 / iscale);
    }
    QActs {
        act: ActType::Q8K,
        cols,
        d,
        s: Vec::new(),
        bsums,
        qs,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// candle's matmul of a quantized weight with `tokens` rows of `x`: the `[tokens, rows]`
    /// reference the k-quant tests compare with.
    pub(crate) fn candle_forward(
        w: candle_core::quantized::QTensor,
        x: &[f32],
        tokens: usize,
    ) -> Vec<f32> {
        use candle_core::{Device, Module, Tensor};
        let xt = Tensor::from_slice(x, (tokens, x.len() / tokens), &Device::Cpu).unwrap();
        candle_core::quantized::QMatMul::from_qtensor(w)
            .unwrap()
            .forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// GGUF bytes of a random-ish matrix in `qtype` (built by hand, independent of candle).
    pub(crate) fn gguf_bytes(qtype: QType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let mut out = Vec::new();
        if qtype.is_k_quant() {
            // Every byte random but the f16 scales: all scales, minimums and quants occur.
            for _ in 0..rows * cols / QK_K {
                let d = f16::from_f32((next() % 1000) as f32 / 500_000.0 + 1e-5);
                let dmin = f16::from_f32((next() % 1000) as f32 / 1_000_000.0);
                let at = out.len();
                out.extend((0..qtype.block_bytes()).map(|_| next() as u8));
                let d_at = if qtype == QType::Q4K { at } else { at + 208 };
                out[d_at..d_at + 2].copy_from_slice(&d.to_le_bytes());
                if qtype == QType::Q4K {
                    out[at + 2..at + 4].copy_from_slice(&dmin.to_le_bytes());
                }
            }
            return out;
        }
        for _ in 0..rows * cols / QK {
            let d = f16::from_f32((next() % 1000) as f32 / 50_000.0 + 1e-4);
            out.extend_from_slice(&d.to_le_bytes());
            if qtype == QType::Q4_1 {
                let m = f16::from_f32(-((next() % 1000) as f32) / 20_000.0);
                out.extend_from_slice(&m.to_le_bytes());
            }
            for _ in 0..qtype.quant_bytes() {
                out.push(next() as u8);
            }
        }
        out
    }

    #[test]
    fn per_row_layout_dequantizes_like_candle() {
        use candle_core::quantized::{GgmlDType, QStorage, QTensor};
        use candle_core::Device;
        for (qt, g) in [
            (QType::Q4_0, GgmlDType::Q4_0),
            (QType::Q4_1, GgmlDType::Q4_1),
            (QType::Q8_0, GgmlDType::Q8_0),
            (QType::Q4K, GgmlDType::Q4K),
            (QType::Q6K, GgmlDType::Q6K),
        ] {
            let (rows, cols) = (3, 96 * qt.block_elems() / QK);
            let bytes = gguf_bytes(qt, rows, cols, 7);
            let storage =
                QStorage::from_data(std::borrow::Cow::Owned(bytes.clone()), &Device::Cpu, g)
                    .unwrap();
            let t = QTensor::new(storage, (rows, cols)).unwrap();
            let want: Vec<Vec<f32>> = t.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            let w = QMatrix::from_gguf(qt, rows, cols, &bytes).unwrap();
            for (r, want) in want.iter().enumerate() {
                let mut got = vec![0f32; cols];
                dequantize_row(&w, r, &mut got);
                assert_eq!(&got, want, "{qt:?} row {r}");
            }
        }
    }

    #[test]
    fn a_prefill_quantized_on_the_pool_equals_its_rows_one_by_one() {
        // 40 rows of 576: 720 blocks, three pool items (the last one short).
        let cols = 576;
        let x: Vec<f32> = (0..40 * cols)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 97.0)
            .collect();
        for act in [ActType::Q8_0, ActType::Q8_1] {
            let all = quantize_acts(&x, cols, act);
            for (r, row) in x.chunks(cols).enumerate() {
                let one = quantize_acts(row, cols, act);
                let nb = cols / QK;
                assert_eq!(one.qs, all.qs[r * cols..(r + 1) * cols]);
                assert_eq!(one.d, all.d[r * nb..(r + 1) * nb]);
                assert_eq!(one.s, all.s.get(r * nb..(r + 1) * nb).unwrap_or(&[]));
            }
        }
    }

    #[test]
    fn vector_and_scalar_activation_quantization_agree_bit_for_bit() {
        // Blocks of every shape: ordinary, all zero, one spike, ties at .5 after scaling,
        // negative extremes (−128 never occurs: |q| ≤ 127).
        let mut x: Vec<f32> = (0..64 * QK)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 97.0)
            .collect();
        x[QK..2 * QK].fill(0.0);
        x[2 * QK..3 * QK].fill(1e-3);
        x[2 * QK + 5] = -1e4;
        for (i, v) in x[3 * QK..4 * QK].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5 * 127.0 / 8.0;
        }
        let nb = x.len() / QK;
        for act in [ActType::Q8_0, ActType::Q8_1] {
            let zeros = || vec![MaybeUninit::new(0i8); x.len()];
            let bytes = |q: Vec<MaybeUninit<i8>>| -> Vec<i8> {
                // SAFETY: initialised (zeros, then the quantizer's writes).
                q.into_iter().map(|v| unsafe { v.assume_init() }).collect()
            };
            let (mut d0, mut s0, mut q0) = (vec![0f32; nb], vec![0f32; nb], zeros());
            quantize_blocks_scalar(&x, act, &mut d0, &mut s0, &mut q0);
            let (mut d1, mut s1, mut q1) = (vec![0f32; nb], vec![0f32; nb], zeros());
            quantize_blocks(&x, act, &mut d1, &mut s1, &mut q1);
            let (q0, q1) = (bytes(q0), bytes(q1));
            assert_eq!(q0, q1, "{act:?}");
            assert!(d0.iter().zip(&d1).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(s0.iter().zip(&s1).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert_eq!(q0[2 * QK + 5], -127);
        }
    }

    #[test]
    fn activation_quantization_matches_the_reference_rules() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.5) * 0.37).collect();
        let a = quantize_acts(&x, 64, ActType::Q8_1);
        for b in 0..2 {
            let blk = &x[b * 32..(b + 1) * 32];
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            // The block's largest magnitude maps to ±127.
            let (imax, _) = blk
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            assert_eq!(a.qs[b * 32 + imax].unsigned_abs(), 127);
            assert_eq!(a.d[b], f16::from_f32(amax / 127.0).to_f32());
            let sum: i32 = a.qs[b * 32..(b + 1) * 32].iter().map(|&q| q as i32).sum();
            assert_eq!(a.s[b], f16::from_f32(amax / 127.0 * sum as f32).to_f32());
            for (&q, &v) in a.qs[b * 32..(b + 1) * 32].iter().zip(blk) {
                let err = (q as f32 * amax / 127.0 - v).abs();
                assert!(err <= amax / 127.0 * 0.5 + 1e-6);
            }
        }
        let z = quantize_acts(&[0.0; 32], 32, ActType::Q8_0);
        assert_eq!(z.d[0], 0.0);
        assert!(z.qs.iter().all(|&q| q == 0));
    }

    /// llama.cpp's `quantize_row_q8_K_ref`, transcribed line by line (its `nearest_int` adds
    /// 1.5 · 2²³ and reads the low mantissa bits).
    fn quantize_row_q8_k_ref(x: &[f32]) -> (Vec<f32>, Vec<i8>, Vec<i16>) {
        fn nearest_int(fval: f32) -> i32 {
            assert!(fval.abs() <= 4_194_303.0);
            let val = fval + 12_582_912.0;
            (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
        }
        let (mut ds, mut qs, mut bsums) = (vec![], vec![], vec![]);
        for x in x.chunks(QK_K) {
            let mut max = 0f32;
            let mut amax = 0f32;
            for &v in x {
                let ax = v.abs();
                if ax > amax {
                    amax = ax;
                    max = v;
                }
            }
            if amax == 0.0 {
                ds.push(0.0);
                qs.extend([0i8; QK_K]);
                bsums.extend([0i16; QK_K / 16]);
                continue;
            }
            let iscale = -127.0 / max;
            let q: Vec<i8> = x
                .iter()
                .map(|&v| nearest_int(iscale * v).min(127) as i8)
                .collect();
            for j in 0..QK_K / 16 {
                let mut sum = 0i32;
                for ii in 0..16 {
                    sum += q[j * 16 + ii] as i32;
                }
                bsums.push(sum as i16);
            }
            qs.extend(q);
            ds.push(1.0 / iscale);
        }
        (ds, qs, bsums)
    }

    #[test]
    fn q8k_activations_match_llama_cpps_reference_quantizer() {
        let cols = 3 * QK_K;
        // Halves (ties to even), a negative largest element, a positive one, and a zero block.
        let mut x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 333.0)
            .collect();
        x[5] = -9.0;
        x[QK_K + 7] = 12.7;
        x[QK_K + 8] = 0.05;
        x[QK_K + 9] = -0.15;
        x[2 * QK_K..3 * QK_K].fill(0.0);
        let a = quantize_acts(&x, cols, ActType::Q8K);
        let (d, qs, bsums) = quantize_row_q8_k_ref(&x);
        assert_eq!(a.blocks(), 3);
        assert_eq!(a.rows(), 2);
        assert_eq!(a.qs, qs);
        assert_eq!(a.bsums, bsums);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.d), bits(&d));
        // The largest magnitude maps to −127 whatever its sign: `d` carries the sign.
        assert_eq!((a.qs[5], a.qs[QK_K + 7]), (-127, -127));
        assert!(a.d[0] > 0.0 && a.d[1] < 0.0 && a.d[2] == 0.0);
    }
}
