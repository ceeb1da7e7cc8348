// Writes the new tokens' K and V (from the fused QKV rows) into one layer's paged KV region.
//
// slots[t] is the token's global slot, block_id * block_size + slot_in_block (negative: skip).
// Destination: [K|V][block][kv_head][slot_in_block][head_dim], the layout the host's KvLayout
// documents, in the cache element type (f32 or f16).
// Launch: grid (tokens), block a multiple of 32 (launch.rs).

template <typename C>
__device__ __forceinline__ void write_kv_impl(const float* qkv, const pd_i64* slots, int qkv_w,
                                              int q_heads, int kv_heads, int head_dim,
                                              int block_size, int num_blocks, C* cache) {
    const int t = blockIdx.x;
    const pd_i64 global = slots[t];
    if (global < 0) return;
    const pd_i64 block = global / block_size;
    const int slot = (int)(global % block_size);
    const float* row = qkv + (pd_i64)t * qkv_w;
    for (int i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) {
        const int g = i / head_dim, j = i % head_dim;
        const float k = row[(q_heads + g) * head_dim + j];
        const float v = row[(q_heads + kv_heads + g) * head_dim + j];
        pd_store(cache + pd_slot_offset(0, block, g, slot, num_blocks, kv_heads, block_size,
                                         head_dim) + j,
                 k);
        pd_store(cache + pd_slot_offset(1, block, g, slot, num_blocks, kv_heads, block_size,
                                         head_dim) + j,
                 v);
    }
}

#define PD_WRITE_KV(NAME, C)                                                                  \
    extern "C" __global__ void NAME(const float* qkv, const pd_i64* slots, int qkv_w,         \
                                    int q_heads, int kv_heads, int head_dim, int block_size,  \
                                    int num_blocks, C* cache) {                               \
        write_kv_impl<C>(qkv, slots, qkv_w, q_heads, kv_heads, head_dim, block_size,          \
                         num_blocks, cache);                                                  \
    }

PD_WRITE_KV(write_kv_f32, float)
PD_WRITE_KV(write_kv_f16, pd_f16)
