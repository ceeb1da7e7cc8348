//! Block formats: weights (Q4_0, Q4_1, Q8_0) in a per-row structure of arrays, activations
//! quantized per row to Q8_0 / Q8_1.

use half::f16;

/// Elements per quantization block (all the formats here).
pub const QK: usize = 32;

/// A weight block format this module runs natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    /// `d: f16, qs: [u8; 16]`, value `(q − 8) · d` (low nibbles are elements 0..16).
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`, value `q · d + m`.
    Q4_1,
    /// `d: f16, qs: [i8; 32]`, value `q · d`.
    Q8_0,
}

impl QType {
    /// Bytes of one GGUF block.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q8_0 => 34,
        }
    }

    /// Bytes of quants in one block.
    pub fn quant_bytes(self) -> usize {
        match self {
            QType::Q4_0 | QType::Q4_1 => 16,
            QType::Q8_0 => 32,
        }
    }

    /// The activation format llama.cpp pairs with this weight format (`vec_dot_type`).
    pub fn act_type(self) -> ActType {
        match self {
            QType::Q4_1 => ActType::Q8_1,
            QType::Q4_0 | QType::Q8_0 => ActType::Q8_0,
        }
    }

    /// From candle's dtype tag, for the types this module runs.
    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        match dtype {
            G::Q4_0 => Some(QType::Q4_0),
            G::Q4_1 => Some(QType::Q4_1),
            G::Q8_0 => Some(QType::Q8_0),
            _ => None,
        }
    }
}

/// A quantized weight matrix `[rows, cols]`, each row laid out as: all its quants
/// (`blocks × quant_bytes`), then its scales (`blocks × f16`), then (Q4_1) its minimums.
#[derive(Clone, Debug)]
pub struct QMatrix {
    qtype: QType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl QMatrix {
    /// Rebuilds GGUF's row-major array of blocks (`rows · cols / 32` blocks) into the per-row
    /// layout. Returns `None` when `cols` is not a whole number of blocks or the byte count
    /// does not match.
    pub fn from_gguf(qtype: QType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        if !cols.is_multiple_of(QK) || bytes.len() != rows * cols / QK * qtype.block_bytes() {
            return None;
        }
        let nb = cols / QK;
        let (bb, qb) = (qtype.block_bytes(), qtype.quant_bytes());
        let mut data = vec![0u8; bytes.len()];
        for r in 0..rows {
            let src = &bytes[r * nb * bb..(r + 1) * nb * bb];
            let dst = &mut data[r * nb * bb..(r + 1) * nb * bb];
            let (qs, rest) = dst.split_at_mut(nb * qb);
            let (ds, ms) = rest.split_at_mut(nb * 2);
            for b in 0..nb {
                let blk = &src[b * bb..(b + 1) * bb];
                ds[b * 2..b * 2 + 2].copy_from_slice(&blk[0..2]);
                let q0 = match qtype {
                    QType::Q4_1 => {
                        ms[b * 2..b * 2 + 2].copy_from_slice(&blk[2..4]);
                        4
                    }
                    _ => 2,
                };
                qs[b * qb..(b + 1) * qb].copy_from_slice(&blk[q0..q0 + qb]);
            }
        }
        Some(Self {
            qtype,
            rows,
            cols,
            data,
        })
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

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Row `r`'s quants, scales (f16 bits) and minimums (f16 bits; empty unless Q4_1).
    #[inline]
    pub(crate) fn row(&self, r: usize) -> RowRef<'_> {
        let nb = self.blocks();
        let row =
            &self.data[r * nb * self.qtype.block_bytes()..(r + 1) * nb * self.qtype.block_bytes()];
        let (qs, rest) = row.split_at(nb * self.qtype.quant_bytes());
        let (d, m) = rest.split_at(nb * 2);
        RowRef { qs, d, m }
    }
}

/// One weight row's arrays.
#[derive(Clone, Copy)]
pub(crate) struct RowRef<'a> {
    pub qs: &'a [u8],
    /// f16 scales, little-endian bytes.
    pub d: &'a [u8],
    /// f16 minimums (Q4_1), little-endian bytes.
    pub m: &'a [u8],
}

impl RowRef<'_> {
    #[inline]
    pub fn d(&self, b: usize) -> f32 {
        f16::from_le_bytes([self.d[2 * b], self.d[2 * b + 1]]).to_f32()
    }
    #[inline]
    pub fn m(&self, b: usize) -> f32 {
        f16::from_le_bytes([self.m[2 * b], self.m[2 * b + 1]]).to_f32()
    }
}

/// Row `r` of a weight matrix as f32 (embedding lookups, tests).
pub fn dequantize_row(w: &QMatrix, r: usize, out: &mut [f32]) {
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
}

/// Token rows of activations quantized to [`ActType`]: per block a scale `d` and (Q8_1) the
/// sum term `s`, both already rounded through f16 as llama.cpp stores them, and 32 quants.
#[derive(Clone, Debug)]
pub struct QActs {
    act: ActType,
    cols: usize,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
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
        self.cols / QK
    }
}

/// Quantizes `x` (`rows × cols`, row-major; `cols` a multiple of 32) block by block as
/// llama.cpp's AVX2 `quantize_row_q8_0` / `quantize_row_q8_1` do: `amax = max |x|`,
/// `d = amax / 127`, `q = round_half_even(x · (127 / amax))`, `s = d · Σq`, with `d` and `s`
/// stored as f16.
///
/// # Panics
/// When `cols` is not a multiple of 32 or `x.len()` of `cols`.
pub fn quantize_acts(x: &[f32], cols: usize, act: ActType) -> QActs {
    assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols.max(1)));
    let nblocks = x.len() / QK;
    let mut d = Vec::with_capacity(nblocks);
    let mut s = Vec::with_capacity(if act == ActType::Q8_1 { nblocks } else { 0 });
    let mut qs = vec![0i8; x.len()];
    for (blk, q) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in q.iter_mut().zip(blk) {
            let r = (v * id).round_ties_even() as i32;
            let r = r.clamp(-128, 127);
            sum += r;
            *q = r as i8;
        }
        d.push(f16::from_f32(db).to_f32());
        if act == ActType::Q8_1 {
            s.push(f16::from_f32(db * sum as f32).to_f32());
        }
    }
    QActs {
        act,
        cols,
        d,
        s,
        qs,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
        ] {
            let (rows, cols) = (3, 96);
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
}
