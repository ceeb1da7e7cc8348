//! Paged attention on the CPU, for every sequence, KV head group and query tile of a step in
//! parallel on the compute pool.
//!
//! **One arithmetic per query row.** A row's result depends only on its query, the K and V of
//! the positions it sees and how many there are — never on which step carries it, where a
//! prefill was cut into chunks, what else is batched, or how many threads or ranks run. The
//! context is split into parts of [`SPLIT_TOKENS`] positions counted from position 0; per part
//! the row's largest score, sum of exponentials and unnormalised output are computed one way
//! ([`attend_part`]: FMA dot products, exponentials and FMA sums in position order), and the
//! parts are joined in order by their log-sum-exp (flash-decoding's merge, [`join_parts`]).
//! So a prefix computed in one prefill chunk, in five, or restored from another instance's
//! cache gives the same bits, and what follows it the same tokens: a prefix-cache hit, a KV
//! tier restore and a P/D hand-off are exact, not just close.
//!
//! Two kinds of work item:
//! - **a query tile** (a prefill's up to [`QUERY_TILE`] tokens, or a short decode): its parts
//!   one after another, joined at the end ([`attend_rows`]);
//! - **a part of a long decode** (few rows, more than one part of context): one item per part,
//!   joined after the items ran, so a single sequence's attention spreads over every thread.
//!
//! Which kind an item is depends only on its own sequence; either kind runs the same
//! arithmetic.

use crate::batch::Batch;
use crate::kv::{HeadBlock, KvCache, KvKind};
use crate::quant;

/// Queries per attention work item, bounding the score matrix of long prefills.
const QUERY_TILE: usize = 128;

/// Query rows (tokens × heads of a KV group) up to which a long context's parts run as items
/// of their own.
const DIRECT_ROWS: usize = 8;

/// Context positions per part of every row's attention (rounded to whole blocks).
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
                    // A long decode: its parts run as items of their own, on every thread.
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
        let res = attend_rows(&rows, ctx.div_ceil(bs), part_blocks);
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

/// One part (blocks `b0..b1`) of the attention of `rows`: for each of the `nq` rows, the
/// largest score among the positions it sees there, the sum of `exp(score − max)` and the
/// unnormalised output `Σ exp(score − max)·v`, into `res` as `[max; nq] ++ [sum; nq] ++
/// [out; nq·hd]` (a row that sees no position gets max −∞, sum 0).
///
/// Each value is defined per row, whatever the other rows: a score is [`dot_fma`]`(q, k) ·
/// scale`, the exponentials are summed by [`crate::vecmath::exp_shifted`] from the part's
/// first position, and each output element is one FMA chain in position order. The kernels
/// below compute several rows and positions at once without changing that arithmetic.
fn attend_part<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    (b0, b1): (usize, usize),
    res: &mut [f32],
) {
    let (q, nq, hd, scale, bs) = (rows.q, rows.nq, rows.hd, rows.scale, rows.bs);
    let (limit, block) = (&rows.limit, &rows.block);
    let p0 = b0 * bs;
    let span = (b1 - b0) * bs;
    // Positions of the part each row sees.
    let seen: Vec<usize> = (0..nq)
        .map(|r| limit(r).min(p0 + span).saturating_sub(p0))
        .collect();
    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
    let k = part_f32((b0..b1).map(|b| block(b).0), &mut kbuf);
    let v = part_f32((b0..b1).map(|b| block(b).1), &mut vbuf);
    let mut scores = vec![0f32; nq * span];
    // Scores block by block (its K stays in L1 while every row passes over it), two rows at a
    // time ([`block_scores`]); a row's values past what it sees are computed with its
    // partner's and never read.
    for (b, kb) in k.iter().enumerate() {
        let mut r = 0;
        while r < nq {
            let pair = r + 1 < nq;
            let n = if pair {
                seen[r].max(seen[r + 1])
            } else {
                seen[r]
            };
            let here = bs.min(n.saturating_sub(b * bs));
            if here == 0 {
                r += 1 + pair as usize;
                continue;
            }
            let (q0, q1) = (
                &q[r * hd..(r + 1) * hd],
                &q[(r + pair as usize) * hd..][..hd],
            );
            let (s0, s1) = scores[r * span..].split_at_mut(span);
            // (`s1` is empty for a last row without a partner.)
            let at1 = (b * bs).min(s1.len());
            let (s0, s1) = (&mut s0[b * bs..], &mut s1[at1..]);
            block_scores(q0, pair.then_some(q1), &kb[..here * hd], scale, s0, s1);
            r += 1 + pair as usize;
        }
    }
    let (ml, out) = res.split_at_mut(2 * nq);
    let out = &mut out[..nq * hd];
    for (r, &n) in seen.iter().enumerate() {
        let row = &mut scores[r * span..r * span + n];
        if row.is_empty() {
            (ml[r], ml[nq + r]) = (f32::NEG_INFINITY, 0.0);
            continue;
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        ml[r] = max;
        ml[nq + r] = crate::vecmath::exp_shifted(row, max) as f32;
    }
    // Outputs block by block (its V stays in L1), two rows at a time ([`weighted_sum`]).
    out.fill(0.0);
    for (b, vb) in v.iter().enumerate() {
        let mut r = 0;
        while r < nq {
            let two = r + 1 < nq;
            let last = r + two as usize;
            let n = [seen[r], seen[last]].map(|n| bs.min(n.saturating_sub(b * bs)));
            if n[0].max(n[1]) > 0 {
                let w = [
                    &scores[r * span + b * bs..],
                    &scores[last * span + b * bs..],
                ];
                let (o0, o1) = out[r * hd..].split_at_mut(hd);
                let o1 = two.then(|| &mut o1[..hd]);
                weighted_sum(w, n, vb, o0, o1);
            }
            r += 1 + two as usize;
        }
    }
}

/// The part's blocks as f32 rows: borrowed from an f32 cache, widened once into `buf` from a
/// half one.
fn part_f32<'a: 'b, 'b>(
    blocks: impl Iterator<Item = HeadBlock<'a>>,
    buf: &'b mut Vec<f32>,
) -> Vec<&'b [f32]> {
    let blocks: Vec<HeadBlock<'a>> = blocks.collect();
    if let Some(f32s) = blocks
        .iter()
        .map(|b| match b {
            HeadBlock::F32(s) => Some(*s),
            _ => None,
        })
        .collect::<Option<Vec<&'a [f32]>>>()
    {
        return f32s;
    }
    let len = blocks.first().map_or(0, |b| match b {
        HeadBlock::F32(s) => s.len(),
        HeadBlock::F16(s) => s.len(),
        HeadBlock::Bf16(s) => s.len(),
    });
    buf.resize(blocks.len() * len, 0.0);
    for (b, dst) in blocks.iter().zip(buf.chunks_mut(len.max(1))) {
        b.copy_to(dst);
    }
    buf.chunks(len.max(1)).collect()
}

/// `s0[p] = dot_fma(q0, kₚ)·scale` for each row `kₚ` of `k` (`hd` values each), and `s1`
/// likewise from `q1` when given: each score exactly [`dot_fma`]'s value, several at once.
fn block_scores(
    q0: &[f32],
    q1: Option<&[f32]>,
    k: &[f32],
    scale: f32,
    s0: &mut [f32],
    s1: &mut [f32],
) {
    let hd = q0.len();
    let n = k.len() / hd;
    assert!(s0.len() >= n && q1.is_none_or(|q1| q1.len() == hd && s1.len() >= n));
    let mut p = 0;
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if hd.is_multiple_of(16) {
        // SAFETY: every pointer below stays inside its slice: rows of `hd` values, positions
        // `p..p + 4 <= n` (or `+ 8`), and `s0`/`s1` hold `n` scores (asserted).
        unsafe {
            let (kp, o0) = (k.as_ptr(), s0.as_mut_ptr());
            match q1 {
                Some(q1) => {
                    let o1 = s1.as_mut_ptr();
                    while p + 4 <= n {
                        let k4 = [0, 1, 2, 3].map(|j| kp.add((p + j) * hd));
                        x86::scores_2x4(
                            q0.as_ptr(),
                            q1.as_ptr(),
                            k4,
                            hd,
                            scale,
                            o0.add(p),
                            o1.add(p),
                        );
                        p += 4;
                    }
                }
                None => {
                    while p + 8 <= n {
                        let k8 = [0, 1, 2, 3, 4, 5, 6, 7].map(|j| kp.add((p + j) * hd));
                        x86::scores_1x8(q0.as_ptr(), k8, hd, scale, o0.add(p));
                        p += 8;
                    }
                }
            }
        }
    }
    for p in p..n {
        let kp = &k[p * hd..(p + 1) * hd];
        s0[p] = dot_fma(q0, kp) * scale;
        if let Some(q1) = q1 {
            s1[p] = dot_fma(q1, kp) * scale;
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod x86 {
    //! Several [`super::dot_fma`]s at once, each with its sixteen lanes (`lo`, `hi`) and its
    //! final additions in its order: `h = lo + hi`, then `((h0+h4)+(h1+h5)) + ((h2+h6)+(h3+h7))`
    //! — the 128-bit halves of `h` first (`halves`), then adjacent lanes twice (`hadd`).
    use std::arch::x86_64::*;

    /// Sixteen-lane FMA sums of four (query, key) pairs of `hd` (a multiple of 16) values,
    /// each folded to `[h0+h4, h1+h5, h2+h6, h3+h7]`: returned as `([pair 0 | pair 1],
    /// [pair 2 | pair 3])`; pair `i` is `(q[i], k[i])`.
    ///
    /// # Safety
    /// The pointers point at `hd` readable values.
    #[inline(always)]
    unsafe fn four(q: [*const f32; 4], k: [*const f32; 4], hd: usize) -> (__m256, __m256) {
        // SAFETY: the caller's promise; the build enables AVX2 and FMA.
        unsafe {
            let z = _mm256_setzero_ps();
            let mut acc = [z; 8];
            let mut c = 0;
            while c < hd {
                for i in 0..4 {
                    let (a, b) = (q[i].add(c), k[i].add(c));
                    acc[2 * i] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b), acc[2 * i]);
                    acc[2 * i + 1] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(a.add(8)),
                        _mm256_loadu_ps(b.add(8)),
                        acc[2 * i + 1],
                    );
                }
                c += 16;
            }
            let h: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
            let halves = |a: __m256, b: __m256| {
                _mm256_add_ps(
                    _mm256_permute2f128_ps(a, b, 0x20),
                    _mm256_permute2f128_ps(a, b, 0x31),
                )
            };
            (halves(h[0], h[1]), halves(h[2], h[3]))
        }
    }

    /// Eight pairs' folds from two [`four`]s, finished: lanes
    /// `[p0, p2, p4, p6, p1, p3, p5, p7]` (pairs numbered as passed: `a` holds 0–3).
    #[inline(always)]
    unsafe fn finish(a: (__m256, __m256), b: (__m256, __m256)) -> __m256 {
        // SAFETY: the build enables AVX2.
        unsafe { _mm256_hadd_ps(_mm256_hadd_ps(a.0, a.1), _mm256_hadd_ps(b.0, b.1)) }
    }

    /// Rows `q0`, `q1` against keys `k[0..4]`: `o0[j] = (q0·kⱼ)·scale`, `o1[j] = (q1·kⱼ)·scale`.
    ///
    /// # Safety
    /// `q0`, `q1` and each `k[j]` point at `hd` (a multiple of 16) readable values, `o0` and
    /// `o1` at four writable ones.
    #[inline(always)]
    pub(super) unsafe fn scores_2x4(
        q0: *const f32,
        q1: *const f32,
        k: [*const f32; 4],
        hd: usize,
        scale: f32,
        o0: *mut f32,
        o1: *mut f32,
    ) {
        // SAFETY: the caller's promise; the build enables AVX2 and FMA.
        unsafe {
            // Pairs q0k0, q0k1, q1k0, q1k1 | q0k2, q0k3, q1k2, q1k3.
            let a = four([q0, q0, q1, q1], [k[0], k[1], k[0], k[1]], hd);
            let b = four([q0, q0, q1, q1], [k[2], k[3], k[2], k[3]], hd);
            // Lanes q0k0, q1k0, q0k2, q1k2, q0k1, q1k1, q0k3, q1k3, into row order.
            let order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
            let z = _mm256_permutevar8x32_ps(finish(a, b), order);
            let z = _mm256_mul_ps(z, _mm256_set1_ps(scale));
            _mm_storeu_ps(o0, _mm256_castps256_ps128(z));
            _mm_storeu_ps(o1, _mm256_extractf128_ps(z, 1));
        }
    }

    /// Row `q0` against keys `k[0..8]`: `o0[j] = (q0·kⱼ)·scale`.
    ///
    /// # Safety
    /// `q0` and each `k[j]` point at `hd` (a multiple of 16) readable values, `o0` at eight
    /// writable ones.
    #[inline(always)]
    pub(super) unsafe fn scores_1x8(
        q0: *const f32,
        k: [*const f32; 8],
        hd: usize,
        scale: f32,
        o0: *mut f32,
    ) {
        // SAFETY: the caller's promise; the build enables AVX2 and FMA.
        unsafe {
            let a = four([q0; 4], [k[0], k[1], k[2], k[3]], hd);
            let b = four([q0; 4], [k[4], k[5], k[6], k[7]], hd);
            // Lanes k0, k2, k4, k6, k1, k3, k5, k7, into order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let z = _mm256_permutevar8x32_ps(finish(a, b), order);
            _mm256_storeu_ps(o0, _mm256_mul_ps(z, _mm256_set1_ps(scale)));
        }
    }
}

/// `o0 += Σ_{p < n[0]} w[0][p]·vₚ` and, if given, `o1` likewise from `w[1]`, `n[1]`, with
/// `vₚ` row `p` of `v`: each element continues its FMA chain in position order, each `vₚ`
/// read once for both rows.
fn weighted_sum(w: [&[f32]; 2], n: [usize; 2], v: &[f32], o0: &mut [f32], o1: Option<&mut [f32]>) {
    let hd = o0.len();
    let both = if o1.is_some() { n[0].min(n[1]) } else { 0 };
    let mut o1 = o1;
    let mut d0 = 0;
    // Thirty-two elements of both rows in registers while the positions stream by.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if let Some(o) = o1.as_deref_mut() {
        use std::arch::x86_64::*;
        assert!(v.len() >= both * hd && w[0].len() >= both && w[1].len() >= both);
        assert_eq!(o.len(), hd);
        while d0 + 32 <= hd {
            // SAFETY: the build enables AVX2 and FMA; each load is inside a position's `hd`
            // values (`d0 + 32 <= hd`, `both` positions, asserted), each store inside `o0`/`o`.
            unsafe {
                let (pa, pb) = (o0.as_mut_ptr().add(d0), o.as_mut_ptr().add(d0));
                let mut a: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(pa.add(8 * j)));
                let mut b: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(pb.add(8 * j)));
                let mut vp = v.as_ptr().add(d0);
                for p in 0..both {
                    let wa = _mm256_set1_ps(*w[0].get_unchecked(p));
                    let wb = _mm256_set1_ps(*w[1].get_unchecked(p));
                    for j in 0..4 {
                        let x = _mm256_loadu_ps(vp.add(8 * j));
                        a[j] = _mm256_fmadd_ps(wa, x, a[j]);
                        b[j] = _mm256_fmadd_ps(wb, x, b[j]);
                    }
                    vp = vp.add(hd);
                }
                for j in 0..4 {
                    _mm256_storeu_ps(pa.add(8 * j), a[j]);
                    _mm256_storeu_ps(pb.add(8 * j), b[j]);
                }
            }
            d0 += 32;
        }
    }
    // The rest, element by element in the same order (the compiler vectorises over `d`).
    let rest = |o: &mut [f32], w: &[f32], from: usize, to: usize, d0: usize| {
        if d0 == hd {
            return;
        }
        for p in from..to {
            let vp = &v[p * hd..(p + 1) * hd];
            o[d0..]
                .iter_mut()
                .zip(&vp[d0..])
                .for_each(|(o, &x)| *o = w[p].mul_add(x, *o));
        }
    };
    // Elements from `d0` on take positions from 0, the others from `both` on.
    rest(o0, w[0], 0, both, d0);
    rest(o0, w[0], both, n[0], 0);
    if let Some(o) = o1 {
        rest(o, w[1], 0, both, d0);
        rest(o, w[1], both, n[1], 0);
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

/// All `rows` over the context's `blocks`: each part of `part_blocks` blocks in turn
/// ([`attend_part`]), then joined per row ([`join_parts`]). Returns `[nq, hd]`.
fn attend_rows<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    blocks: usize,
    part_blocks: usize,
) -> Vec<f32> {
    let (nq, hd) = (rows.nq, rows.hd);
    let stride = nq * (hd + 2);
    let parts = blocks.div_ceil(part_blocks);
    let mut partial = vec![0f32; parts * stride];
    for (p, res) in partial.chunks_mut(stride).enumerate() {
        let b0 = p * part_blocks;
        attend_part(rows, (b0, (b0 + part_blocks).min(blocks)), res);
    }
    let parts: Vec<&[f32]> = partial.chunks(stride).collect();
    let mut out = vec![0f32; nq * hd];
    for (r, row) in out.chunks_mut(hd).enumerate() {
        join_parts(&parts, r, nq, hd, row);
    }
    out
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
