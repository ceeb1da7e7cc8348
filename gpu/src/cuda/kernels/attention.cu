// Paged attention for a mixed batch of prefill chunks and decode tokens.
//
// One thread block per (token, query head). Token t belongs to sequence tok_seq[t] and sits at
// position tok_pos[t]; it attends causally to positions 0..=tok_pos[t] of its sequence, whose
// K/V live in the blocks block_tables[seq_bt_start[seq] + position / block_size] of one
// layer's paged region ([K|V][block][kv_head][slot][head_dim]). The K/V of every token of
// this step were written before this kernel runs (same stream), so prefill chunks and decode
// tokens need no separate paths. Query head h reads KV head h / (q_heads / kv_heads) (GQA).
//
// Each of the block's warps walks every ATTN_WARPS-th key with an online softmax (running max,
// running sum, running weighted V); the warps' partial results are merged at the end, so the
// context length is bounded only by the block table. head_dim <= 32 * PD_ATTN_MAX_DIMS_PER_LANE.
// Launch: grid (tokens, q_heads), block 32 * ATTN_WARPS (launch.rs).

#define PD_ATTN_WARPS 16
#define PD_ATTN_MAX_DIMS_PER_LANE 8
#define PD_ATTN_MAX_HEAD_DIM (32 * PD_ATTN_MAX_DIMS_PER_LANE)

template <typename C, typename T>
__device__ __forceinline__ void paged_attention_impl(
    const float* qkv, int qkv_w, int q_heads, int kv_heads, int head_dim, const int* tok_seq,
    const int* tok_pos, const int* seq_bt_start, const int* block_tables, int block_size,
    int num_blocks, const C* cache, float scale, T* out) {
    __shared__ float q_s[PD_ATTN_MAX_HEAD_DIM];
    __shared__ float m_s[PD_ATTN_WARPS];
    __shared__ float l_s[PD_ATTN_WARPS];
    __shared__ float acc_s[PD_ATTN_WARPS][PD_ATTN_MAX_HEAD_DIM];

    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (q_heads / kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    const float* q = qkv + (pd_i64)t * qkv_w + (pd_i64)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) q_s[i] = q[i];
    __syncthreads();

    const int n_ctx = tok_pos[t] + 1;
    const int* bt = block_tables + seq_bt_start[tok_seq[t]];

    float m = -PD_INF;
    float l = 0.0f;
    float acc[PD_ATTN_MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) acc[i] = 0.0f;

    for (int j = warp; j < n_ctx; j += PD_ATTN_WARPS) {
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
            if (d < head_dim) part += q_s[d] * pd_load(k + d);
        }
        const float s = pd_warp_sum(part) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < PD_ATTN_MAX_DIMS_PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * corr + p * pd_load(v + d);
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

    float big = -PD_INF;
    for (int w = 0; w < PD_ATTN_WARPS; w++) big = fmaxf(big, m_s[w]);
    float total = 0.0f;
    for (int w = 0; w < PD_ATTN_WARPS; w++) {
        if (l_s[w] > 0.0f) total += l_s[w] * expf(m_s[w] - big);
    }
    T* o = out + (pd_i64)t * q_heads * head_dim + (pd_i64)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < PD_ATTN_WARPS; w++) {
            if (l_s[w] > 0.0f) sum += acc_s[w][d] * expf(m_s[w] - big);
        }
        pd_store(o + d, sum / total);
    }
}

#define PD_PAGED_ATTENTION(NAME, C, T)                                                        \
    extern "C" __global__ void NAME(                                                          \
        const float* qkv, int qkv_w, int q_heads, int kv_heads, int head_dim,                 \
        const int* tok_seq, const int* tok_pos, const int* seq_bt_start,                      \
        const int* block_tables, int block_size, int num_blocks, const C* cache, float scale, \
        T* out) {                                                                             \
        paged_attention_impl<C, T>(qkv, qkv_w, q_heads, kv_heads, head_dim, tok_seq, tok_pos, \
                                   seq_bt_start, block_tables, block_size, num_blocks, cache, \
                                   scale, out);                                               \
    }

PD_PAGED_ATTENTION(paged_attention_f32_f32, float, float)
PD_PAGED_ATTENTION(paged_attention_f32_f16, float, pd_f16)
PD_PAGED_ATTENTION(paged_attention_f32_bf16, float, pd_bf16)
PD_PAGED_ATTENTION(paged_attention_f16_f32, pd_f16, float)
PD_PAGED_ATTENTION(paged_attention_f16_f16, pd_f16, pd_f16)
PD_PAGED_ATTENTION(paged_attention_f16_bf16, pd_f16, pd_bf16)
