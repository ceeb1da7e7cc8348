// Paged attention for a mixed batch of prefill chunks and decode tokens.
//
// Token t belongs to sequence tok_seq[t] and sits at position tok_pos[t]; it attends causally
// to positions 0..=tok_pos[t] of its sequence, whose K/V live in the blocks
// block_tables[seq_bt_start[seq] + position / block_size] of one layer's paged region
// ([K|V][block][kv_head][slot][head_dim]). The K/V of every token of this step were written
// before this kernel runs (same stream), so prefill chunks and decode tokens need no separate
// paths. Query head h reads KV head h / (q_heads / kv_heads) (GQA).
//
// A row's context is cut into parts of PD_ATTN_PART keys counted from position 0. In a part,
// each of the block's warps walks every ATTN_WARPS-th key with an online softmax (running max,
// running sum, running weighted V) and the warps' results are merged in warp order into the
// part's (max, sum, unnormalized output). The parts are then folded in order by pd_attn_fold.
// A row's arithmetic therefore depends on its position alone, never on the batch it is in.
// Two launches compute the same bits:
//   - whole (gridDim.z == 1): one block per (token, head) walks the parts in order, folding;
//   - split (gridDim.z == parts of the longest row): one block per (token, head, part) writes
//     its part to `partials`, and attention_combine_* folds them in order. Few rows over a
//     long context (decode) then spread over the whole GPU instead of one block per head.
// head_dim <= 32 * PD_ATTN_MAX_DIMS_PER_LANE. Launch geometry: launch.rs (`attention`).

#define PD_ATTN_WARPS 16
#define PD_ATTN_PART 256
#define PD_ATTN_MAX_DIMS_PER_LANE 8
#define PD_ATTN_MAX_HEAD_DIM (32 * PD_ATTN_MAX_DIMS_PER_LANE)

// The factor that carries a running value taken at max m over to the new max m_new: 0 while
// nothing has been folded (m = -inf). Every step below is written with explicit roundings
// (__fmaf_rn, __fmul_rn, ...), so no contraction choice of the compiler can make the whole and
// split launches differ in a bit.
__device__ __forceinline__ float pd_attn_fold_scale(float m, float m_new) {
    return m == -PD_INF ? 0.0f : expf(__fsub_rn(m, m_new));
}

// Attention of one row over keys [begin, end) of its context. Every thread gets the part's
// max (*part_m) and sum (*part_l); thread d < head_dim gets output element d, unnormalized
// (*part_acc). Uses the block's shared scratch and ends with a barrier, so it can be called
// again at once. The block has PD_ATTN_WARPS warps: blockDim.x >= PD_ATTN_MAX_HEAD_DIM.
template <typename C>
__device__ __forceinline__ void pd_attn_part(const float* q_s, int begin, int end,
                                             const int* bt, int block_size, int num_blocks,
                                             int kv_heads, int g, int head_dim,
                                             const C* cache, float scale, float* m_s,
                                             float* l_s, float (*acc_s)[PD_ATTN_MAX_HEAD_DIM],
                                             float* part_m, float* part_l, float* part_acc) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    float m = -PD_INF;
    float l = 0.0f;
    float acc[PD_ATTN_MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) acc[i] = 0.0f;

    for (int j = begin + warp; j < end; j += PD_ATTN_WARPS) {
        const pd_i64 block = bt[j / block_size];
        const int slot = j % block_size;
        const C* k = cache + pd_slot_offset(0, block, g, slot, num_blocks, kv_heads, block_size,
                                            head_dim);
        const C* v = cache + pd_slot_offset(1, block, g, slot, num_blocks, kv_heads, block_size,
                                            head_dim);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) part = __fmaf_rn(q_s[d], pd_load(k + d), part);
        }
        const float s = __fmul_rn(pd_warp_sum(part), scale);
        const float m_new = fmaxf(m, s);
        const float corr = pd_attn_fold_scale(m, m_new);
        const float p = expf(__fsub_rn(s, m_new));
        l = __fmaf_rn(l, corr, p);
#pragma unroll
        for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = __fmaf_rn(acc[i], corr, __fmul_rn(p, pd_load(v + d)));
        }
        m = m_new;
    }

    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < head_dim) acc_s[warp][d] = acc[i];
    }
    __syncthreads();

    // The warps' results, merged in warp order (warps without keys have l = 0).
    float big = -PD_INF;
    for (int w = 0; w < PD_ATTN_WARPS; w++) big = fmaxf(big, m_s[w]);
    float total = 0.0f;
    for (int w = 0; w < PD_ATTN_WARPS; w++) {
        if (l_s[w] > 0.0f) total = __fmaf_rn(l_s[w], expf(__fsub_rn(m_s[w], big)), total);
    }
    *part_m = big;
    *part_l = total;
    const int d = threadIdx.x;
    if (d < head_dim) {
        float sum = 0.0f;
        for (int w = 0; w < PD_ATTN_WARPS; w++) {
            if (l_s[w] > 0.0f) sum = __fmaf_rn(acc_s[w][d], expf(__fsub_rn(m_s[w], big)), sum);
        }
        *part_acc = sum;
    }
    __syncthreads();
}

// Folds one part (pm, pl, pa) into a running (m, l, a): the same expression in the whole
// launch and in attention_combine_*.
__device__ __forceinline__ void pd_attn_fold(float& m, float& l, float& a, float pm, float pl,
                                             float pa) {
    const float m_new = fmaxf(m, pm);
    const float ca = pd_attn_fold_scale(m, m_new);
    const float cb = expf(__fsub_rn(pm, m_new));
    l = __fmaf_rn(l, ca, __fmul_rn(pl, cb));
    a = __fmaf_rn(a, ca, __fmul_rn(pa, cb));
    m = m_new;
}

template <typename C, typename T>
__device__ __forceinline__ void paged_attention_impl(
    const float* qkv, int qkv_w, int q_heads, int kv_heads, int head_dim, const int* tok_seq,
    const int* tok_pos, const int* seq_bt_start, const int* block_tables, int block_size,
    int num_blocks, const C* cache, float scale, float* partials, T* out) {
    __shared__ float q_s[PD_ATTN_MAX_HEAD_DIM];
    __shared__ float m_s[PD_ATTN_WARPS];
    __shared__ float l_s[PD_ATTN_WARPS];
    __shared__ float acc_s[PD_ATTN_WARPS][PD_ATTN_MAX_HEAD_DIM];

    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (q_heads / kv_heads);
    const int n_ctx = tok_pos[t] + 1;
    const int n_parts = (n_ctx + PD_ATTN_PART - 1) / PD_ATTN_PART;
    const bool split = gridDim.z > 1;
    // Split: this block's part only. A block past its row's context has nothing to do and
    // leaves whole, before any barrier.
    const int first = split ? (int)blockIdx.z : 0;
    const int last = split ? (int)blockIdx.z + 1 : n_parts;
    if (first >= n_parts) return;

    const float* q = qkv + (pd_i64)t * qkv_w + (pd_i64)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) q_s[i] = q[i];
    __syncthreads();
    const int* bt = block_tables + seq_bt_start[tok_seq[t]];
    const int d = threadIdx.x;

    float m = -PD_INF, l = 0.0f, a = 0.0f;
    for (int p = first; p < last; p++) {
        const int begin = p * PD_ATTN_PART;
        const int end = min(n_ctx, begin + PD_ATTN_PART);
        float pm, pl, pa = 0.0f;
        pd_attn_part<C>(q_s, begin, end, bt, block_size, num_blocks, kv_heads, g, head_dim,
                        cache, scale, m_s, l_s, acc_s, &pm, &pl, &pa);
        if (split) {
            float* dst = partials +
                         (((pd_i64)t * q_heads + h) * gridDim.z + p) * (pd_i64)(head_dim + 2);
            if (d == 0) {
                dst[0] = pm;
                dst[1] = pl;
            }
            if (d < head_dim) dst[2 + d] = pa;
            return;
        }
        pd_attn_fold(m, l, a, pm, pl, pa);
    }
    if (d < head_dim) {
        T* o = out + (pd_i64)t * q_heads * head_dim + (pd_i64)h * head_dim;
        pd_store(o + d, __fdiv_rn(a, l));
    }
}

// Folds the parts a split launch wrote, in order, exactly as the whole launch does.
// Launch: grid (tokens, q_heads), block of whole warps covering head_dim (launch.rs).
template <typename T>
__device__ __forceinline__ void attention_combine_impl(const float* partials, int q_heads,
                                                       int head_dim, int max_parts,
                                                       const int* tok_pos, T* out) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int n_parts = (tok_pos[t] + 1 + PD_ATTN_PART - 1) / PD_ATTN_PART;
    const float* src = partials + ((pd_i64)t * q_heads + h) * max_parts * (pd_i64)(head_dim + 2);
    T* o = out + (pd_i64)t * q_heads * head_dim + (pd_i64)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float m = -PD_INF, l = 0.0f, a = 0.0f;
        for (int p = 0; p < n_parts; p++) {
            const float* part = src + (pd_i64)p * (head_dim + 2);
            pd_attn_fold(m, l, a, part[0], part[1], part[2 + d]);
        }
        pd_store(o + d, __fdiv_rn(a, l));
    }
}

#define PD_PAGED_ATTENTION(NAME, C, T)                                                        \
    extern "C" __global__ void NAME(                                                          \
        const float* qkv, int qkv_w, int q_heads, int kv_heads, int head_dim,                 \
        const int* tok_seq, const int* tok_pos, const int* seq_bt_start,                      \
        const int* block_tables, int block_size, int num_blocks, const C* cache, float scale, \
        float* partials, T* out) {                                                            \
        paged_attention_impl<C, T>(qkv, qkv_w, q_heads, kv_heads, head_dim, tok_seq, tok_pos, \
                                   seq_bt_start, block_tables, block_size, num_blocks, cache, \
                                   scale, partials, out);                                     \
    }

PD_PAGED_ATTENTION(paged_attention_f32_f32, float, float)
PD_PAGED_ATTENTION(paged_attention_f32_f16, float, pd_f16)
PD_PAGED_ATTENTION(paged_attention_f32_bf16, float, pd_bf16)
PD_PAGED_ATTENTION(paged_attention_f16_f32, pd_f16, float)
PD_PAGED_ATTENTION(paged_attention_f16_f16, pd_f16, pd_f16)
PD_PAGED_ATTENTION(paged_attention_f16_bf16, pd_f16, pd_bf16)

#define PD_ATTENTION_COMBINE(NAME, T)                                                          \
    extern "C" __global__ void NAME(const float* partials, int q_heads, int head_dim,          \
                                    int max_parts, const int* tok_pos, T* out) {               \
        attention_combine_impl<T>(partials, q_heads, head_dim, max_parts, tok_pos, out);       \
    }

PD_ATTENTION_COMBINE(attention_combine_f32, float)
PD_ATTENTION_COMBINE(attention_combine_f16, pd_f16)
PD_ATTENTION_COMBINE(attention_combine_bf16, pd_bf16)
