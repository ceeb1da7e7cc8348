// Rotary position embedding, in place, on the Q and K heads of each token's fused QKV row.
//
// qkv is [tokens, qkv_w] f32 with the row laid out Q heads | K heads | V heads; the first
// `heads` heads (Q and K) are rotated by the angle of the token's position, read from the
// cos/sin tables [position][head_dim / 2] the host computed once (the CPU backend's own
// table, so both backends rotate by bit-identical factors). Two pairings:
//   rope_interleaved: (2j, 2j+1)        llama.cpp "normal" rope (GGUF llama)
//   rope_half:        (j, j + hd/2)     NeoX style (HF checkpoints, GGUF qwen2)
// Launch: grid (tokens), block a multiple of 32 (launch.rs).

__device__ __forceinline__ void pd_rotate(float* a, float* b, float c, float s) {
    const float x = *a, y = *b;
    *a = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
    *b = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
}

// HALF: pairs (j, j + hd/2); otherwise (2j, 2j + 1).
template <bool HALF>
__device__ __forceinline__ void rope_impl(float* qkv, const int* pos, int qkv_w, int heads,
                                          int head_dim, const float* cos_t,
                                          const float* sin_t) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const float* c = cos_t + (pd_i64)pos[t] * half;
    const float* s = sin_t + (pd_i64)pos[t] * half;
    float* row = qkv + (pd_i64)t * qkv_w;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int h = i / half, j = i % half;
        float* x = row + h * head_dim;
        if (HALF) {
            pd_rotate(x + j, x + j + half, c[j], s[j]);
        } else {
            pd_rotate(x + 2 * j, x + 2 * j + 1, c[j], s[j]);
        }
    }
}

#define PD_ROPE(NAME, HALF)                                                                   \
    extern "C" __global__ void NAME(float* qkv, const int* pos, int qkv_w, int heads,         \
                                    int head_dim, const float* cos_t, const float* sin_t) {   \
        rope_impl<HALF>(qkv, pos, qkv_w, heads, head_dim, cos_t, sin_t);                      \
    }

PD_ROPE(rope_interleaved, false)
PD_ROPE(rope_half, true)
