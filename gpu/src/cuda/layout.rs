//! Index arithmetic shared by the host and the kernels, as pure functions.
//!
//! - The device KV region of a layer has exactly the host layout ([`KvLayout`]):
//!   `[K|V][block][kv_head][slot_in_block][head_dim]`. [`slot_elem_offset`] is the formula the
//!   kernels use (`pd_slot_offset` in `common.cuh`), tested against [`KvLayout::slot_offset`]
//!   so device bytes and host bytes of a block are interchangeable: a transfer copies a
//!   [`KvLayout::span`] between them unchanged.
//! - Matmuls are row-major `Y[rows, out] = X[rows, in] · W[out, in]ᵀ` while cuBLAS is
//!   column-major; [`linear_gemm`] gives the cuBLAS arguments and [`gemm_reference`] runs
//!   them with column-major semantics on the host, so the mapping is tested, not assumed.

use crate::kv::{KvKind, KvLayout, KvSpan};
use std::ops::Range;

/// Element offset of `(kind, block, head, slot)` inside one layer's region (`pd_slot_offset`).
pub fn slot_elem_offset(
    l: &KvLayout,
    kind: KvKind,
    block: usize,
    head: usize,
    slot: usize,
) -> usize {
    (((kind as usize) * l.num_blocks + block) * l.num_kv_heads + head) * l.block_size * l.head_dim
        + slot * l.head_dim
}

/// Elements of one layer's region.
pub fn region_elems(l: &KvLayout) -> usize {
    2 * l.num_blocks * l.num_kv_heads * l.block_size * l.head_dim
}

/// cuBLAS operation on an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

/// The arguments of one column-major `C = op(A) · op(B)` (cuBLAS `gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    /// Operation on A.
    pub op_a: Op,
    /// Operation on B.
    pub op_b: Op,
    /// Rows of op(A) and C.
    pub m: usize,
    /// Columns of op(B) and C.
    pub n: usize,
    /// Columns of op(A), rows of op(B).
    pub k: usize,
    /// Leading dimension of A.
    pub lda: usize,
    /// Leading dimension of B.
    pub ldb: usize,
    /// Leading dimension of C.
    pub ldc: usize,
}

/// cuBLAS arguments for the row-major linear layer `Y[rows, out] = X[rows, inp] · W[out, inp]ᵀ`
/// with A = W, B = X, C = Y.
///
/// Column-major, a row-major `[r, c]` buffer is its `[c, r]` transpose: Y is `Yᵀ[out, rows]`,
/// X is `Xᵀ[inp, rows]` and W is `Wᵀ[inp, out]`. So `Yᵀ = W · Xᵀ = op_T(Wᵀ) · Xᵀ`.
pub fn linear_gemm(rows: usize, inp: usize, out: usize) -> GemmArgs {
    GemmArgs {
        op_a: Op::T,
        op_b: Op::N,
        m: out,
        n: rows,
        k: inp,
        lda: inp,
        ldb: inp,
        ldc: out,
    }
}

/// Runs `args` with cuBLAS's column-major semantics (`beta = 0`) on host slices: the oracle
/// the mapping is tested against.
pub fn gemm_reference(args: &GemmArgs, a: &[f32], b: &[f32], c: &mut [f32]) {
    let at = |i: usize, p: usize| match args.op_a {
        Op::N => a[i + p * args.lda],
        Op::T => a[p + i * args.lda],
    };
    let bt = |p: usize, j: usize| match args.op_b {
        Op::N => b[p + j * args.ldb],
        Op::T => b[j + p * args.ldb],
    };
    for j in 0..args.n {
        for i in 0..args.m {
            let mut s = 0f32;
            for p in 0..args.k {
                s += at(i, p) * bt(p, j);
            }
            c[i + j * args.ldc] = s;
        }
    }
}

/// Sorted, de-duplicated runs of consecutive block ids (one copy per run instead of per block).
pub fn block_runs(blocks: &[u32]) -> Vec<Range<usize>> {
    let mut b: Vec<usize> = blocks.iter().map(|&x| x as usize).collect();
    b.sort_unstable();
    b.dedup();
    let mut runs: Vec<Range<usize>> = Vec::new();
    for x in b {
        match runs.last_mut() {
            Some(r) if r.end == x => r.end = x + 1,
            _ => runs.push(x..x + 1),
        }
    }
    runs
}

/// Runs of `(src, dst)` block pairs that are consecutive on both sides, as
/// `(src_start, dst_start, len)`, in the order given.
pub fn pair_runs(pairs: &[(u32, u32)]) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for &(s, d) in pairs {
        let (s, d) = (s as usize, d as usize);
        match runs.last_mut() {
            Some((s0, d0, n)) if *s0 + *n == s && *d0 + *n == d => *n += 1,
            _ => runs.push((s, d, 1)),
        }
    }
    runs
}

/// The K and V byte spans of blocks `run` (all heads) of `layer`: each is contiguous because
/// blocks are the outer index inside a K (or V) half.
pub fn run_spans(l: &KvLayout, layer: usize, run: &Range<usize>) -> [KvSpan; 2] {
    [KvKind::Key, KvKind::Value].map(|kind| {
        let first = l.span(layer, kind, run.start, 0..l.num_kv_heads);
        KvSpan {
            region: layer,
            offset: first.offset,
            len: run.len() * l.block_bytes(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvDtype;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 3,
            num_blocks: 7,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn device_slot_offsets_are_the_host_layout() {
        let l = layout();
        let es = l.dtype.size();
        assert_eq!(region_elems(&l) * es, l.region_bytes());
        for kind in [KvKind::Key, KvKind::Value] {
            for block in 0..l.num_blocks {
                for head in 0..l.num_kv_heads {
                    let span = l.span(1, kind, block, head..head + 1);
                    for slot in 0..l.block_size {
                        let e = slot_elem_offset(&l, kind, block, head, slot);
                        assert_eq!(e * es, l.slot_offset(kind, block, head, slot));
                        // Inside the span a transfer would copy for (block, head).
                        assert!(e * es >= span.offset);
                        assert!((e + l.head_dim) * es <= span.offset + span.len);
                    }
                }
            }
        }
    }

    #[test]
    fn linear_gemm_computes_x_times_w_transposed() {
        let (rows, inp, out) = (5, 7, 3);
        let x: Vec<f32> = (0..rows * inp).map(|i| (i % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..out * inp).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
        let mut want = vec![0f32; rows * out];
        for r in 0..rows {
            for o in 0..out {
                want[r * out + o] = (0..inp).map(|i| x[r * inp + i] * w[o * inp + i]).sum();
            }
        }
        let args = linear_gemm(rows, inp, out);
        let mut got = vec![f32::NAN; rows * out];
        gemm_reference(&args, &w, &x, &mut got);
        assert_eq!(got, want);
        // Leading dimensions fit the buffers exactly (cuBLAS reads lda * cols of A, etc.).
        assert_eq!(args.lda * args.m, w.len());
        assert_eq!(args.ldb * args.n, x.len());
        assert_eq!(args.ldc * args.n, want.len());
    }

    #[test]
    fn block_runs_coalesce_sorted_unique_ids() {
        assert_eq!(block_runs(&[]), Vec::<Range<usize>>::new());
        assert_eq!(block_runs(&[5, 3, 4, 4, 9, 0]), vec![0..1, 3..6, 9..10]);
    }

    #[test]
    fn run_spans_are_exactly_the_union_of_the_blocks_spans() {
        let l = KvLayout {
            num_blocks: 10,
            block_size: 4,
            head_dim: 8,
            ..layout()
        };
        let blocks = [7u32, 2, 3, 4, 9];
        let mut from_runs = vec![false; l.region_bytes()];
        for run in block_runs(&blocks) {
            for s in run_spans(&l, 1, &run) {
                assert_eq!(s.region, 1);
                for b in &mut from_runs[s.offset..s.offset + s.len] {
                    assert!(!*b, "overlap");
                    *b = true;
                }
            }
        }
        let mut from_blocks = vec![false; l.region_bytes()];
        for &b in &blocks {
            for kind in [KvKind::Key, KvKind::Value] {
                let s = l.span(1, kind, b as usize, 0..l.num_kv_heads);
                from_blocks[s.offset..s.offset + s.len]
                    .iter_mut()
                    .for_each(|x| *x = true);
            }
        }
        assert_eq!(from_runs, from_blocks);
    }

    #[test]
    fn pair_runs_need_both_sides_consecutive() {
        assert_eq!(
            pair_runs(&[(0, 5), (1, 6), (2, 7), (3, 9), (4, 10), (8, 11)]),
            vec![(0, 5, 3), (3, 9, 2), (8, 11, 1)]
        );
    }
}
