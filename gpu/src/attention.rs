//! Paged attention on the CPU, for every sequence, KV head group and query tile of a step in
//! parallel on the compute pool.
//!
//! Three kinds of work item:
//! - **prefill tiles** (more than [`DIRECT_ROWS`] query rows): the context's K and V gathered
//!   once, two GEMMs with a causal mask ([`attend_gemm`]);
//! - **short decodes** (few rows, at most [`SPLIT_TOKENS`] of context): K and V read straight
//!   from the blocks ([`attend_direct`]);
//! - **long decodes**: the context split into parts of [`SPLIT_TOKENS`] positions, one item
//!   each ([`attend_part`]: its rows' maximum score, sum of exponentials and unnormalised
//!   output), then joined exactly (flash-decoding's log-sum-exp merge). A single sequence's
//!   attention then spreads over every thread, and each part reads its K and V once for all
//!   the rows of its group, an f16/bf16 cache through one reused buffer.
//!
//! Which kind an item is depends only on its own sequence (its rows and context length), never
//! on the rest of the batch or on the number of threads or ranks, so results stay batch-,
//! thread- and tp-invariant.

use crate::batch::Batch;
use crate::kv::{HeadBlock, KvCache, KvKind};
use crate::quant;

/// Queries per attention work item, bounding the score matrix of long prefills.
const QUERY_TILE: usize = 128;

/// Query rows (tokens × heads of a KV group) up to which an item reads K and V straight from
/// the blocks instead of gathering them for GEMMs.
const DIRECT_ROWS: usize = 8;

/// Context positions per part of a long decode's attention (rounded to whole blocks).
const SPLIT_TOKENS: usize = 256;

/// One work item: sequence `si`, KV group `g`, query tokens `i0..i1`, and for a part of a
/// long decode its blocks and the slot of its partial result.
#[derive(Clone, Copy)]
struct Item {
    si: usize,
    g: usize,
    i0: usize,
    i1: usize,
    part: Option<Part>,
}

#[derive(Clone, Copy)]
struct Part {
    blocks: (usize, usize),
    slot: usize,
}

/// One work item's query rows (`nq` rows of `hd`, ordered (token, head-in-group)) and the
/// context they attend to: row `r` sees positions `0..limit(r)`; `block(b)` is the K and V
/// of context block `b` (`bs` positions).
struct Rows<'q, L, B> {
    q: &'q [f32],
    nq: usize,
    hd: usize,
    scale: f32,
    limit: L,
    block: B,
    bs: usize,
}

/// A long decode's parts, joined after the items ran.
struct Split {
    item: Item,
    first_slot: usize,
    parts: usize,
}

/// Paged attention for every sequence, KV head and query tile in parallel. Returns
/// `[tokens, nh * hd]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    layer: usize,
    batch: &Batch,
    offsets: &[usize],
    qkv: &[f32],
    qkv_w: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    kv: &KvCache,
) -> Vec<f32> {
    let group = nh / nkv;
    let t = batch.num_tokens();
    let bs = kv.layout().block_size;
    let part_blocks = (SPLIT_TOKENS / bs).max(1);
    let mut items = Vec::new();
    let mut splits = Vec::new();
    let mut slots = 0;
    for (si, s) in batch.seqs.iter().enumerate() {
        for g in 0..nkv {
            let mut i0 = 0;
            while i0 < s.tokens.len() {
                let i1 = (i0 + QUERY_TILE).min(s.tokens.len());
                let item = Item {
                    si,
                    g,
                    i0,
                    i1,
                    part: None,
                };
                let blocks = (s.start_pos + i1).div_ceil(bs);
                if (i1 - i0) * group <= DIRECT_ROWS && blocks > part_blocks {
                    let parts = blocks.div_ceil(part_blocks);
                    splits.push(Split {
                        item,
                        first_slot: slots,
                        parts,
                    });
                    items.extend((0..parts).map(|p| Item {
                        part: Some(Part {
                            blocks: (p * part_blocks, ((p + 1) * part_blocks).min(blocks)),
                            slot: slots + p,
                        }),
                        ..item
                    }));
                    slots += parts;
                } else {
                    items.push(item);
                }
                i0 = i1;
            }
        }
    }
    // Largest first (queries × context): the threads claim items in this order, so the last
    // ones to finish are small and no thread waits long for another at the end.
    items.sort_by_key(|it| {
        let span = match it.part {
            Some(p) => (p.blocks.1 - p.blocks.0) * bs,
            None => batch.seqs[it.si].start_pos + it.i1,
        };
        std::cmp::Reverse((it.i1 - it.i0) * span)
    });
    let scale = 1.0 / (hd as f32).sqrt();
    // One pool for all compute: the matmul workers also run attention, so no second pool spins
    // against them on a small machine.
    // Written by the items in place (each item its tokens' rows of its heads; together they
    // cover every value) before its length is set.
    let mut out = Vec::<f32>::with_capacity(t * nh * hd);
    let dst = SharedOut(out.as_mut_ptr());
    // Each part's result: per row its maximum score, sum of exponentials and output.
    let stride = DIRECT_ROWS * (hd + 2);
    let mut partial = vec![0f32; slots * stride];
    let partial_dst = SharedOut(partial.as_mut_ptr());
    let work = |it: &Item| {
        let s = &batch.seqs[it.si];
        let (g, i0, i1) = (it.g, it.i0, it.i1);
        let off = offsets[it.si];
        // Query rows ordered (token, head-in-group).
        let nq = (i1 - i0) * group;
        let mut q = Vec::with_capacity(nq * hd);
        for i in i0..i1 {
            let row = &qkv[(off + i) * qkv_w..(off + i + 1) * qkv_w];
            for j in 0..group {
                let head = g * group + j;
                q.extend_from_slice(&row[head * hd..(head + 1) * hd]);
            }
        }
        let ctx = s.start_pos + i1;
        let limit = |r: usize| s.start_pos + i0 + r / group + 1;
        let block = |b: usize| {
            (
                kv.head_block(layer, KvKind::Key, s.block_table[b] as usize, g),
                kv.head_block(layer, KvKind::Value, s.block_table[b] as usize, g),
            )
        };
        let rows = Rows {
            q: &q,
            nq,
            hd,
            scale,
            limit,
            block,
            bs,
        };
        if let Some(part) = it.part {
            // SAFETY: slot `part.slot` is this item's alone, `stride` values inside `partial`.
            let res = unsafe {
                std::slice::from_raw_parts_mut(partial_dst.at(part.slot * stride), stride)
            };
            attend_part(&rows, part.blocks, res);
            return;
        }
        let res = if nq <= DIRECT_ROWS {
            attend_direct(&rows, ctx)
        } else {
            attend_gemm(&rows, ctx)
        };
        // Rows ordered (token, head-in-group), into the output's (token, head) places.
        for (ti, i) in (i0..i1).enumerate() {
            let at = (off + i) * nh * hd + g * group * hd;
            let src = &res[ti * group * hd..(ti + 1) * group * hd];
            // SAFETY: token `off + i`'s heads of group `g` are this item's alone (items are
            // distinct (sequence, group, token range)s), inside `out`'s capacity.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.at(at), src.len()) };
        }
    };
    quant::pool::global().run(items.len(), &|i| work(&items[i]));
    for sp in &splits {
        let it = sp.item;
        let nq = (it.i1 - it.i0) * group;
        let parts: Vec<&[f32]> = (0..sp.parts)
            .map(|p| &partial[(sp.first_slot + p) * stride..(sp.first_slot + p + 1) * stride])
            .collect();
        let mut row = vec![0f32; hd];
        for r in 0..nq {
            join_parts(&parts, r, nq, hd, &mut row);
            let (i, j) = (it.i0 + r / group, r % group);
            let at = (offsets[it.si] + i) * nh * hd + (it.g * group + j) * hd;
            // SAFETY: this (token, head) belongs to the split's sequence and group, which no
            // item wrote (its items wrote only `partial`), inside `out`'s capacity.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.at(at), hd) };
        }
    }
    // SAFETY: the items and splits cover every (sequence, KV group, token) once, so every
    // (token, head) of `out` was written (a panicking item panics above, before this).
    unsafe { out.set_len(t * nh * hd) };
    out
}

/// Row `r` of a long decode from its parts' results (`[max; nq] ++ [sum; nq] ++ [out; nq·hd]`
/// each, see [`attend_part`]): `Σ eᵐᵖ⁻ᴹ·oₚ / Σ eᵐᵖ⁻ᴹ·lₚ` with `M` the largest maximum.
fn join_parts(parts: &[&[f32]], r: usize, nq: usize, hd: usize, row: &mut [f32]) {
    let m = parts.iter().map(|p| p[r]).fold(f32::NEG_INFINITY, f32::max);
    row.fill(0.0);
    let mut l = 0f64;
    for p in parts {
        if p[nq + r] == 0.0 {
            continue; // no position of this part is visible to the row
        }
        let w = crate::vecmath::exp(p[r] - m);
        l += f64::from(w) * f64::from(p[nq + r]);
        let o = &p[2 * nq + r * hd..2 * nq + (r + 1) * hd];
        row.iter_mut()
            .zip(o)
            .for_each(|(x, &o)| *x = w.mul_add(o, *x));
    }
    let inv = (1.0 / l) as f32;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// One part (blocks `b0..b1`) of a long decode's attention: for each of the `nq` rows, the
/// largest score among the positions it sees there, the sum of `exp(score − max)` and the
/// unnormalised output `Σ exp(score − max)·v`, into `res` as `[max; nq] ++ [sum; nq] ++
/// [out; nq·hd]` (a row that sees no position gets max −∞, sum 0). K and V are read once
/// for all rows.
fn attend_part<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    (b0, b1): (usize, usize),
    res: &mut [f32],
) {
    let (q, nq, hd, scale, bs) = (rows.q, rows.nq, rows.hd, rows.scale, rows.bs);
    let (limit, block) = (&rows.limit, &rows.block);
    let p0 = b0 * bs;
    let span = (b1 - b0) * bs;
    let limits: Vec<usize> = (0..nq).map(|r| limit(r).min(p0 + span)).collect();
    let mut scores = vec![0f32; nq * span];
    let mut buf = Vec::new();
    for b in b0..b1 {
        let k = block(b).0.as_f32(&mut buf);
        for slot in 0..bs {
            let p = b * bs + slot;
            let kr = &k[slot * hd..(slot + 1) * hd];
            for (r, &n) in limits.iter().enumerate() {
                if p < n {
                    scores[r * span + p - p0] = dot_fma(&q[r * hd..(r + 1) * hd], kr) * scale;
                }
            }
        }
    }
    let (ml, out) = res.split_at_mut(2 * nq);
    let out = &mut out[..nq * hd];
    out.fill(0.0);
    for (r, &n) in limits.iter().enumerate() {
        let row = &mut scores[r * span..r * span + n.saturating_sub(p0)];
        if row.is_empty() {
            (ml[r], ml[nq + r]) = (f32::NEG_INFINITY, 0.0);
            continue;
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        ml[r] = max;
        ml[nq + r] = crate::vecmath::exp_shifted(row, max) as f32;
    }
    for b in b0..b1 {
        let v = block(b).1.as_f32(&mut buf);
        for slot in 0..bs {
            let p = b * bs + slot;
            let vr = &v[slot * hd..(slot + 1) * hd];
            for (r, &n) in limits.iter().enumerate() {
                if p < n {
                    let w = scores[r * span + p - p0];
                    out[r * hd..(r + 1) * hd]
                        .iter_mut()
                        .zip(vr)
                        .for_each(|(o, &v)| *o = w.mul_add(v, *o));
                }
            }
        }
    }
}

/// A dot product with fused multiply-adds in sixteen independent lanes (two AVX registers
/// where the build targets AVX2 and FMA, as x86-64-v3 does), for the long-decode parts.
#[inline]
fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let whole = n / 16 * 16;
    let mut acc = [0f32; 16];
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: the build enables AVX2 and FMA; every load is inside `0..whole` of both slices.
    unsafe {
        use std::arch::x86_64::*;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..whole).step_by(16) {
            let (pa, pb) = (a.as_ptr().add(c), b.as_ptr().add(c));
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(8)), _mm256_loadu_ps(pb.add(8)), hi);
        }
        _mm256_storeu_ps(acc.as_mut_ptr(), lo);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), hi);
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for c in (0..whole).step_by(16) {
        for l in 0..16 {
            acc[l] = a[c + l].mul_add(b[c + l], acc[l]);
        }
    }
    let h: [f32; 8] = std::array::from_fn(|i| acc[i] + acc[8 + i]);
    let mut s = ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
    for i in whole..n {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// The attention output, written by the work items at disjoint places.
struct SharedOut(*mut f32);
// SAFETY: the items write disjoint ranges (see `attention`), nothing reads while they run.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Few queries (decode): read K and V straight from the blocks.
fn attend_direct<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    ctx: usize,
) -> Vec<f32> {
    let (q, nq, hd, scale, bs) = (rows.q, rows.nq, rows.hd, rows.scale, rows.bs);
    let (limit, block) = (&rows.limit, &rows.block);
    // Each block once, as f32: borrowed from an f32 cache, widened once from a half one.
    let blocks: Vec<_> = (0..ctx.div_ceil(bs))
        .map(|b| {
            let (k, v) = block(b);
            (k.widen(), v.widen())
        })
        .collect();
    let block = |b: usize| (&*blocks[b].0, &*blocks[b].1);
    let mut out = vec![0f32; nq * hd];
    let mut scores = vec![0f32; ctx];
    for r in 0..nq {
        let qr = &q[r * hd..(r + 1) * hd];
        let n = limit(r);
        for b in 0..n.div_ceil(bs) {
            let (kb, _) = block(b);
            for slot in 0..bs.min(n - b * bs) {
                let k = &kb[slot * hd..(slot + 1) * hd];
                scores[b * bs + slot] = dot(qr, k) * scale;
            }
        }
        crate::vecmath::softmax(&mut scores[..n]);
        let o = &mut out[r * hd..(r + 1) * hd];
        for b in 0..n.div_ceil(bs) {
            let (_, vb) = block(b);
            for slot in 0..bs.min(n - b * bs) {
                let w = scores[b * bs + slot];
                let v = &vb[slot * hd..(slot + 1) * hd];
                o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
            }
        }
    }
    out
}

/// Many queries (prefill): gather the context's K and V once, two GEMMs with a causal mask.
fn attend_gemm<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    ctx: usize,
) -> Vec<f32> {
    let (q, nq, hd, scale, bs) = (rows.q, rows.nq, rows.hd, rows.scale, rows.bs);
    let (limit, block) = (&rows.limit, &rows.block);
    let mut k = vec![0f32; ctx * hd];
    let mut v = vec![0f32; ctx * hd];
    for b in 0..ctx.div_ceil(bs) {
        let n = bs.min(ctx - b * bs);
        let (kb, vb) = block(b);
        kb.copy_to(&mut k[b * bs * hd..(b * bs + n) * hd]);
        vb.copy_to(&mut v[b * bs * hd..(b * bs + n) * hd]);
    }
    let mut s = vec![0f32; nq * ctx];
    // S[nq, ctx] = Q[nq, hd] · K[ctx, hd]ᵀ
    // SAFETY: all pointers cover the strided extents passed (row-major, sizes above).
    unsafe {
        gemm::gemm(
            nq,
            ctx,
            hd,
            s.as_mut_ptr(),
            1,
            ctx as isize,
            false,
            q.as_ptr(),
            1,
            hd as isize,
            k.as_ptr(),
            hd as isize,
            1,
            0.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for r in 0..nq {
        let n = limit(r);
        let row = &mut s[r * ctx..(r + 1) * ctx];
        crate::vecmath::softmax(&mut row[..n]);
        row[n..].iter_mut().for_each(|x| *x = 0.0);
    }
    let mut out = vec![0f32; nq * hd];
    // O[nq, hd] = P[nq, ctx] · V[ctx, hd]
    // SAFETY: as above.
    unsafe {
        gemm::gemm(
            nq,
            hd,
            ctx,
            out.as_mut_ptr(),
            1,
            hd as isize,
            false,
            s.as_ptr(),
            1,
            ctx as isize,
            v.as_ptr(),
            1,
            hd as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    out
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociation.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqChunk;
    use crate::kv::{KvDtype, KvLayout};
    use pdserve_runtime::memory::AnonAllocator;

    const NKV: usize = 2;
    const GROUP: usize = 3;
    const NH: usize = NKV * GROUP;
    /// Not a multiple of 16: the dot product's tail runs too.
    const HD: usize = 40;
    const BS: usize = 16;

    /// Pseudo-random values in [-1, 1) (splitmix64), so that parts of a context differ.
    fn value(i: usize) -> f32 {
        let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A one-layer cache holding `ctx` positions of one sequence in `table`'s blocks.
    fn cache(dtype: KvDtype, table: &[u32], ctx: usize, salt: usize) -> KvCache {
        let layout = KvLayout {
            num_layers: 1,
            num_blocks: 128,
            block_size: BS,
            num_kv_heads: NKV,
            head_dim: HD,
            dtype,
        };
        let mut kv = KvCache::new(layout, &AnonAllocator).unwrap();
        for p in 0..ctx {
            for g in 0..NKV {
                let at = |kind: usize| (salt + p * 31 + g * 7 + kind) * HD;
                let k: Vec<f32> = (0..HD).map(|i| value(at(0) + i)).collect();
                let v: Vec<f32> = (0..HD).map(|i| value(at(1) + i)).collect();
                let (b, slot) = (table[p / BS] as usize, p % BS);
                kv.write_slot(0, KvKind::Key, b, g, slot, &k);
                kv.write_slot(0, KvKind::Value, b, g, slot, &v);
            }
        }
        kv
    }

    fn seq(tokens: usize, start_pos: usize, table: &[u32]) -> SeqChunk {
        SeqChunk {
            tokens: vec![0; tokens],
            start_pos,
            block_table: table.to_vec(),
            want_logits: false,
            all_logits: false,
            embeds: Vec::new(),
        }
    }

    /// Queries (the Q part of QKV rows) for `t` tokens.
    fn qkv(t: usize, salt: usize) -> (Vec<f32>, usize) {
        let w = (NH + 2 * NKV) * HD;
        ((0..t * w).map(|i| 2.0 * value(salt + i)).collect(), w)
    }

    /// Attention of token `i` of `s` (at offset `off` in the batch), head `h`, in f64 from the
    /// cache as stored.
    fn exact(
        kv: &KvCache,
        s: &SeqChunk,
        q: &[f32],
        w: usize,
        off: usize,
        i: usize,
        h: usize,
    ) -> Vec<f64> {
        let g = h / GROUP;
        let n = s.start_pos + i + 1;
        let qr = &q[(off + i) * w + h * HD..(off + i) * w + (h + 1) * HD];
        let row = |kind, p: usize| -> Vec<f32> {
            let b = kv
                .head_block(0, kind, s.block_table[p / BS] as usize, g)
                .widen();
            b[(p % BS) * HD..(p % BS + 1) * HD].to_vec()
        };
        let scores: Vec<f64> = (0..n)
            .map(|p| {
                let k = row(KvKind::Key, p);
                qr.iter()
                    .zip(&k)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>()
                    / (HD as f64).sqrt()
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = e.iter().sum();
        let mut out = vec![0f64; HD];
        for (p, e) in e.iter().enumerate() {
            for (o, v) in out.iter_mut().zip(row(KvKind::Value, p)) {
                *o += e / l * f64::from(v);
            }
        }
        out
    }

    /// Long decodes (one token, and two tokens whose rows see different lengths) are split
    /// into parts and joined: equal to exact attention, f32 and f16 caches alike.
    #[test]
    fn split_long_decodes_equal_exact_attention() {
        // Blocks in a scattered order, as a real block table.
        let table: Vec<u32> = (0..60).map(|b| (b * 37 % 128) as u32).collect();
        let ctx = 900; // 57 blocks: 4 parts of 16 blocks
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let kv = cache(dtype, &table, ctx, 5);
            let batch = Batch {
                seqs: vec![seq(1, ctx - 1, &table), seq(2, ctx - 2, &table)],
            };
            let (q, w) = qkv(3, 99);
            let out = attention(0, &batch, &[0, 1], &q, w, NH, NKV, HD, &kv);
            for (si, off) in [(0, 0), (1, 1)] {
                let s = &batch.seqs[si];
                for i in 0..s.tokens.len() {
                    for h in 0..NH {
                        let want = exact(&kv, s, &q, w, off, i, h);
                        let got = &out[(off + i) * NH * HD + h * HD..][..HD];
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (f64::from(*g) - w).abs() < 2e-5,
                                "{dtype:?} seq {si} token {i} head {h}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A sequence's attention does not depend on what else is in the batch, long or short.
    #[test]
    fn a_sequence_attends_the_same_alone_and_in_a_batch() {
        let table: Vec<u32> = (0..60).collect();
        let other: Vec<u32> = (60..70).collect();
        let ctx = 700;
        let mut kv = cache(KvDtype::F32, &table, ctx, 1);
        let short = cache(KvDtype::F32, &other, 100, 3);
        for b in 60..70 {
            for kind in [KvKind::Key, KvKind::Value] {
                for g in 0..NKV {
                    let src = short.head_block(0, kind, b, g).widen().to_vec();
                    for slot in 0..BS {
                        kv.write_slot(0, kind, b, g, slot, &src[slot * HD..(slot + 1) * HD]);
                    }
                }
            }
        }
        let (q, w) = qkv(1 + 40, 7);
        let alone = attention(
            0,
            &Batch {
                seqs: vec![seq(1, ctx - 1, &table)],
            },
            &[0],
            &q,
            w,
            NH,
            NKV,
            HD,
            &kv,
        );
        // The same query row first in a batch with a 40-token prefill chunk.
        let batch = Batch {
            seqs: vec![seq(1, ctx - 1, &table), seq(40, 60, &other)],
        };
        let both = attention(0, &batch, &[0, 1], &q, w, NH, NKV, HD, &kv);
        assert_eq!(alone[..NH * HD], both[..NH * HD]);
    }
}
