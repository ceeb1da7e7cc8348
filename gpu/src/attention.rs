//! Paged attention on the CPU, for every sequence, KV head group and query tile of a step in
//! parallel on the compute pool.
//!
//! **One arithmetic per query row.** A row's result depends only on its query, the K and V of
//! the positions it sees and how many there are — never on which step carries it, where a
//! prefill was cut into chunks, what else is batched, or how many threads or ranks run. The
//! context is split into parts of [`SPLIT_TOKENS`] positions counted from position 0; per part
//! the row's largest score, sum of exponentials and unnormalised output are computed one way
//! ([`attend_part`]: [`dot8`] scores, exponentials and FMA sums in position order), and the
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

/// Query rows the score and output kernels take at once (a token's heads where a KV group
/// has three, as the default model's).
const ROWS: usize = 3;

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

/// Paged attention for every sequence, KV head and query tile of `batch` in parallel on the
/// compute pool, over `layer` of `kv` (which already holds the batch's own K and V): `qkv`
/// holds one row of `qkv_w` values per token, its first `nh * hd` the queries, and sequence
/// `i`'s tokens start at row `offsets[i]`. Returns `[tokens, nh * hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
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
/// Each value is defined per row, whatever the other rows: a score is [`dot8`]`(q, k) ·
/// scale`, the exponentials are summed by [`crate::vecmath::exp_shifted`] from the part's
/// first position, and each output element is one FMA chain in position order. The kernels
/// below compute [`ROWS`] rows and several positions at once without changing that
/// arithmetic.
fn attend_part<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    (b0, b1): (usize, usize),
    res: &mut [f32],
) {
    let (nq, bs) = (rows.nq, rows.bs);
    let (limit, block) = (&rows.limit, &rows.block);
    let p0 = b0 * bs;
    let span = (b1 - b0) * bs;
    // Positions of the part each row sees.
    let seen: Vec<usize> = (0..nq)
        .map(|r| limit(r).min(p0 + span).saturating_sub(p0))
        .collect();
    SCRATCH.with_borrow_mut(|scratch| {
        let Scratch {
            k: kbuf,
            v: vbuf,
            scores,
        } = scratch;
        let k = part_f32((b0..b1).map(|b| block(b).0), kbuf);
        let v = part_f32((b0..b1).map(|b| block(b).1), vbuf);
        // Every score read below is written first (stale values past a row's positions are
        // never read), so the buffer is reused as it is.
        if scores.len() < nq * span {
            scores.resize(nq * span, 0.0);
        }
        part_rows(rows, &seen, span, &k, &v, scores, res);
    });
}

/// A compute thread's buffers for [`attend_part`], reused from part to part.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// [`attend_part`]'s arithmetic over the part's K and V blocks (f32 rows of `bs` positions),
/// row `r` seeing the first `seen[r]` of its `span` positions.
fn part_rows<'a>(
    rows: &Rows<impl Fn(usize) -> usize, impl Fn(usize) -> (HeadBlock<'a>, HeadBlock<'a>)>,
    seen: &[usize],
    span: usize,
    k: &[&[f32]],
    v: &[&[f32]],
    scores: &mut [f32],
    res: &mut [f32],
) {
    let (q, nq, hd, scale, bs) = (rows.q, rows.nq, rows.hd, rows.scale, rows.bs);
    // Scores block by block (its K stays in L1 while every row passes over it), [`ROWS`] rows
    // at a time ([`block_scores`]); a row's values past what it sees are computed with its
    // neighbours' and never read.
    for (b, kb) in k.iter().enumerate() {
        for r in (0..nq).step_by(ROWS) {
            let m = ROWS.min(nq - r);
            let n = seen[r..r + m].iter().copied().max().unwrap_or(0);
            let here = bs.min(n.saturating_sub(b * bs));
            if here > 0 {
                block_scores(
                    &q[r * hd..(r + m) * hd],
                    &kb[..here * hd],
                    hd,
                    scale,
                    &mut scores[r * span + b * bs..],
                    span,
                );
            }
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
    // Outputs block by block (its V stays in L1), [`ROWS`] rows at a time ([`weighted_sum`]).
    out.fill(0.0);
    for (b, vb) in v.iter().enumerate() {
        for r in (0..nq).step_by(ROWS) {
            let m = ROWS.min(nq - r);
            let mut n = [0; ROWS];
            let mut w: [&[f32]; ROWS] = [&[]; ROWS];
            for i in 0..m {
                n[i] = bs.min(seen[r + i].saturating_sub(b * bs));
                w[i] = &scores[(r + i) * span + b * bs..];
            }
            if n[..m].iter().any(|&n| n > 0) {
                weighted_sum(&w[..m], &n[..m], vb, &mut out[r * hd..(r + m) * hd]);
            }
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
    let len = blocks.first().map_or(0, HeadBlock::len);
    buf.resize(blocks.len() * len, 0.0);
    for (b, dst) in blocks.iter().zip(buf.chunks_mut(len.max(1))) {
        b.copy_to(dst);
    }
    buf.chunks(len.max(1)).collect()
}

/// `out[i·stride + p] = dot8(qᵢ, kₚ)·scale` for each of the (up to [`ROWS`]) rows `qᵢ` of `q`
/// and each row `kₚ` of `k`, `hd` values each: every score exactly [`dot8`]'s value, eight
/// positions of every row at once where the build has AVX2 and FMA.
fn block_scores(q: &[f32], k: &[f32], hd: usize, scale: f32, out: &mut [f32], stride: usize) {
    let (m, n) = (q.len() / hd, k.len() / hd);
    assert!(m <= ROWS && (m == 0 || out.len() >= (m - 1) * stride + n));
    let mut p = 0;
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if hd.is_multiple_of(8) {
        while p + 8 <= n {
            let (qp, kp, op) = (q.as_ptr(), k[p * hd..].as_ptr(), out.as_mut_ptr());
            // SAFETY: rows `0..m` of `q` and positions `p..p + 8 <= n` of `k` hold `hd`
            // values each; row `i`'s eight scores at `i·stride + p..+8` lie inside `out`
            // (asserted).
            unsafe {
                let q = |i: usize| qp.add(i * hd);
                let o = |i: usize| op.add(i * stride + p);
                match m {
                    3 => x86::scores_x8([q(0), q(1), q(2)], kp, hd, scale, [o(0), o(1), o(2)]),
                    2 => x86::scores_x8([q(0), q(1)], kp, hd, scale, [o(0), o(1)]),
                    _ => x86::scores_x8([q(0)], kp, hd, scale, [o(0)]),
                }
            }
            p += 8;
        }
    }
    for i in 0..m {
        let qi = &q[i * hd..(i + 1) * hd];
        for p in p..n {
            out[i * stride + p] = dot8(qi, &k[p * hd..(p + 1) * hd]) * scale;
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod x86 {
    //! Many [`super::dot8`]s and output chains at once, each in its own arithmetic: a dot
    //! product's eight lanes `h` (FMA chains over `hd / 8` steps) are added
    //! `((h0+h4)+(h1+h5)) + ((h2+h6)+(h3+h7))` — the 128-bit halves first ([`halves`]), then
    //! adjacent lanes twice (`hadd`).
    use std::arch::x86_64::*;

    /// `[a0+a4, a1+a5, a2+a6, a3+a7, b0+b4, b1+b5, b2+b6, b3+b7]`.
    #[inline(always)]
    unsafe fn halves(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the build enables AVX2.
        unsafe {
            _mm256_add_ps(
                _mm256_permute2f128_ps(a, b, 0x20),
                _mm256_permute2f128_ps(a, b, 0x31),
            )
        }
    }

    /// Four keys' lanes folded halfway: `[s0a, s0b, s2a, s2b, s1a, s1b, s3a, s3b]` with `sja`
    /// `= (hj0+hj4)+(hj1+hj5)` and `sjb = (hj2+hj6)+(hj3+hj7)`.
    #[inline(always)]
    unsafe fn fold4(h: &[__m256; 4]) -> __m256 {
        // SAFETY: the build enables AVX2.
        unsafe { _mm256_hadd_ps(halves(h[0], h[1]), halves(h[2], h[3])) }
    }

    /// Rows `q[i]` against the eight keys at `k` (`hd` values each, `hd` a multiple of 8):
    /// `out[i][j] = dot8(q[i], kⱼ)·scale`, four keys' lanes of every row in registers at a
    /// time.
    ///
    /// # Safety
    /// Each `q[i]` points at `hd` readable values, `k` at `8·hd`, each `out[i]` at eight
    /// writable ones.
    #[inline(always)]
    pub(super) unsafe fn scores_x8<const R: usize>(
        q: [*const f32; R],
        k: *const f32,
        hd: usize,
        scale: f32,
        out: [*mut f32; R],
    ) {
        // SAFETY: the caller's promise; the build enables AVX2 and FMA.
        unsafe {
            let z = _mm256_setzero_ps();
            // Keys `4·half..4·half + 4` of every row, folded halfway.
            let folds = |half: usize| -> [__m256; R] {
                let kp: [*const f32; 4] = std::array::from_fn(|j| k.add((half * 4 + j) * hd));
                let mut acc = [[z; 4]; R];
                let mut c = 0;
                while c < hd {
                    let qv: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(q[i].add(c)));
                    for j in 0..4 {
                        let kv = _mm256_loadu_ps(kp[j].add(c));
                        for i in 0..R {
                            acc[i][j] = _mm256_fmadd_ps(qv[i], kv, acc[i][j]);
                        }
                    }
                    c += 8;
                }
                acc.map(|a| fold4(&a))
            };
            let (lo, hi) = (folds(0), folds(1));
            // Keys 0, 2, 4, 6, 1, 3, 5, 7, into order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let s = _mm256_set1_ps(scale);
            for i in 0..R {
                let c = _mm256_hadd_ps(lo[i], hi[i]);
                _mm256_storeu_ps(out[i], _mm256_mul_ps(_mm256_permutevar8x32_ps(c, order), s));
            }
        }
    }

    /// `o[i][d] += Σ_{p < n} w[i][p]·v[p·hd + d]` for `d` in `0..8·D`: the rows' `8·D`
    /// elements in registers while the positions stream by, each an FMA chain in position
    /// order.
    ///
    /// # Safety
    /// Each `w[i]` points at `n` readable values, `v` at `n` rows of `hd` (from which the
    /// first `8·D` are read), each `o[i]` at `8·D` writable ones.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // a register tile, indexed by row and column
    pub(super) unsafe fn weighted_cols<const R: usize, const D: usize>(
        w: [*const f32; R],
        n: usize,
        v: *const f32,
        hd: usize,
        o: [*mut f32; R],
    ) {
        // SAFETY: the caller's promise; the build enables AVX2 and FMA.
        unsafe {
            let mut a: [[__m256; D]; R] =
                std::array::from_fn(|i| std::array::from_fn(|j| _mm256_loadu_ps(o[i].add(8 * j))));
            let mut vp = v;
            for p in 0..n {
                let wb: [__m256; R] = std::array::from_fn(|i| _mm256_broadcast_ss(&*w[i].add(p)));
                for j in 0..D {
                    let x = _mm256_loadu_ps(vp.add(8 * j));
                    for i in 0..R {
                        a[i][j] = _mm256_fmadd_ps(wb[i], x, a[i][j]);
                    }
                }
                vp = vp.add(hd);
            }
            for i in 0..R {
                for j in 0..D {
                    _mm256_storeu_ps(o[i].add(8 * j), a[i][j]);
                }
            }
        }
    }

    /// [`weighted_cols`] over the first `hd / 8 · 8` elements of `R` rows, 32 at a time then
    /// 8. Returns the elements done.
    ///
    /// # Safety
    /// As [`weighted_cols`], with each `o[i]` pointing at `hd` writable values.
    #[inline(always)]
    pub(super) unsafe fn weighted<const R: usize>(
        w: [*const f32; R],
        n: usize,
        v: *const f32,
        hd: usize,
        o: [*mut f32; R],
    ) -> usize {
        let mut d = 0;
        // SAFETY: the caller's promise; columns `d..d + 32` (or `+ 8`) lie inside `hd`.
        unsafe {
            while d + 32 <= hd {
                weighted_cols::<R, 4>(w, n, v.add(d), hd, o.map(|o| o.add(d)));
                d += 32;
            }
            while d + 8 <= hd {
                weighted_cols::<R, 1>(w, n, v.add(d), hd, o.map(|o| o.add(d)));
                d += 8;
            }
        }
        d
    }
}

/// `oᵢ += Σ_{p < n[i]} w[i][p]·vₚ` for the (up to [`ROWS`]) rows `oᵢ` of `out`, with `vₚ`
/// row `p` of `v`: each element continues its FMA chain in position order. The positions
/// every row takes run in registers for all rows at once, each `vₚ` read once for them.
fn weighted_sum(w: &[&[f32]], n: &[usize], v: &[f32], out: &mut [f32]) {
    let m = w.len();
    let hd = out.len() / m.max(1);
    let both = n.iter().copied().min().unwrap_or(0);
    assert!(m <= ROWS && n.len() == m && v.len() >= both * hd);
    assert!(w.iter().zip(n).all(|(w, &n)| w.len() >= n));
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    let d0 = {
        let (op, vp) = (out.as_mut_ptr(), v.as_ptr());
        // SAFETY: each row's `both <= n[i]` weights, `both` rows of `v` (asserted) and its
        // `hd` outputs (`out` holds `m` rows of `hd`).
        unsafe {
            let o = |i: usize| op.add(i * hd);
            match m {
                3 => x86::weighted(
                    [w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr()],
                    both,
                    vp,
                    hd,
                    [o(0), o(1), o(2)],
                ),
                2 => x86::weighted([w[0].as_ptr(), w[1].as_ptr()], both, vp, hd, [o(0), o(1)]),
                1 => x86::weighted([w[0].as_ptr()], both, vp, hd, [o(0)]),
                _ => 0,
            }
        }
    };
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    let d0 = 0;
    // The rest in the same order: elements from `d0` on over positions `0..both`, then every
    // element over the row's positions past `both` (the compiler vectorises over `d`).
    for (i, o) in out.chunks_mut(hd.max(1)).enumerate() {
        for (from, to, d) in [(0, both, d0), (both, n[i], 0)] {
            if d == hd {
                continue;
            }
            for p in from..to {
                let wp = w[i][p];
                o[d..]
                    .iter_mut()
                    .zip(&v[p * hd + d..(p + 1) * hd])
                    .for_each(|(o, &x)| *o = wp.mul_add(x, *o));
            }
        }
    }
}

/// The score of a query row and a key: a dot product of fused multiply-adds in eight
/// independent lanes (one AVX register where the build targets AVX2 and FMA, as x86-64-v3
/// does; the same arithmetic in scalar code elsewhere), lanes added
/// `((h0+h4)+(h1+h5)) + ((h2+h6)+(h3+h7))`, then the `hd % 8` last products in order.
#[inline]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let whole = n / 8 * 8;
    let mut h = [0f32; 8];
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: the build enables AVX2 and FMA; every load is inside `0..whole` of both slices.
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = _mm256_setzero_ps();
        for c in (0..whole).step_by(8) {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(c)),
                _mm256_loadu_ps(b.as_ptr().add(c)),
                acc,
            );
        }
        _mm256_storeu_ps(h.as_mut_ptr(), acc);
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    for c in (0..whole).step_by(8) {
        for l in 0..8 {
            h[l] = a[c + l].mul_add(b[c + l], h[l]);
        }
    }
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

    /// [`dot8`]'s arithmetic written out lane by lane, as a portable build runs it.
    fn dot8_lanes(a: &[f32], b: &[f32]) -> f32 {
        let whole = a.len() / 8 * 8;
        let mut h = [0f32; 8];
        for c in (0..whole).step_by(8) {
            for l in 0..8 {
                h[l] = a[c + l].mul_add(b[c + l], h[l]);
            }
        }
        let mut s = ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
        for i in whole..a.len() {
            s = a[i].mul_add(b[i], s);
        }
        s
    }

    /// The score and output kernels (one to three rows, eight positions or 32 elements at a
    /// time, and their tails) give every value exactly as the arithmetic defines it.
    #[test]
    fn kernels_keep_the_defined_arithmetic() {
        for hd in [8, 36, 40, 64, 72, 128] {
            for m in 1..=ROWS {
                for n in [0, 1, 7, 8, 9, 16] {
                    let q: Vec<f32> = (0..m * hd).map(|i| value(i + 11 * hd)).collect();
                    let k: Vec<f32> = (0..n * hd).map(|i| value(i + 1000)).collect();
                    let stride = 20;
                    let mut out = vec![f32::NAN; m * stride];
                    block_scores(&q, &k, hd, 0.125, &mut out, stride);
                    for i in 0..m {
                        for p in 0..n {
                            let want =
                                dot8_lanes(&q[i * hd..(i + 1) * hd], &k[p * hd..(p + 1) * hd])
                                    * 0.125;
                            let got = out[i * stride + p];
                            assert_eq!(got.to_bits(), want.to_bits(), "hd {hd} m {m} n {n}");
                        }
                    }
                    // Outputs: rows seeing different numbers of positions, on top of values
                    // already there.
                    let counts: Vec<usize> = (0..m).map(|i| n.saturating_sub(i * 3)).collect();
                    let w: Vec<Vec<f32>> = (0..m)
                        .map(|i| (0..n).map(|p| value(7 * i + p + 5)).collect())
                        .collect();
                    let start: Vec<f32> = (0..m * hd).map(|i| value(i + 77)).collect();
                    let mut got = start.clone();
                    let ws: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
                    weighted_sum(&ws, &counts, &k, &mut got);
                    for i in 0..m {
                        for d in 0..hd {
                            let mut want = start[i * hd + d];
                            for p in 0..counts[i] {
                                want = w[i][p].mul_add(k[p * hd + d], want);
                            }
                            assert_eq!(
                                got[i * hd + d].to_bits(),
                                want.to_bits(),
                                "hd {hd} m {m} n {n} row {i} element {d}"
                            );
                        }
                    }
                }
            }
        }
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
