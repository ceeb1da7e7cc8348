// Prelude of every pdserve kernel source (prepended by the Rust side before NVRTC compiles it).
//
// It needs no header at all: NVRTC ships without the toolkit's cuda_fp16.h / cuda_bf16.h, so
// the two 16-bit float types are plain 16-bit words here, converted with PTX `cvt`
// instructions (round to nearest even, as the host's `half` crate does). bf16 conversion needs
// sm_80 or newer, which is the oldest architecture pdserve builds for.

typedef unsigned short pd_u16;
typedef long long pd_i64;

// +infinity (NVRTC has no math.h, so no INFINITY macro).
#define PD_INF __int_as_float(0x7f800000)

// IEEE binary16, as stored in weights and activations.
struct __align__(2) pd_f16 {
    pd_u16 bits;
};

// bfloat16 (the top half of an f32).
struct __align__(2) pd_bf16 {
    pd_u16 bits;
};

__device__ __forceinline__ float pd_load(const float* p) { return *p; }

__device__ __forceinline__ float pd_load(const pd_f16* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p->bits));
    return f;
}

__device__ __forceinline__ float pd_load(const pd_bf16* p) {
    return __uint_as_float(((unsigned int)p->bits) << 16);
}

__device__ __forceinline__ void pd_store(float* p, float v) { *p = v; }

__device__ __forceinline__ void pd_store(pd_f16* p, float v) {
    pd_u16 b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(v));
    p->bits = b;
}

__device__ __forceinline__ void pd_store(pd_bf16* p, float v) {
    pd_u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    p->bits = b;
}

__device__ __forceinline__ float pd_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float pd_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024). Every thread
// gets the result. `scratch` holds at least 32 floats of shared memory.
__device__ __forceinline__ float pd_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = pd_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return pd_warp_sum(v);
}

// Offset, in elements, of (kind, block, kv_head, slot) inside one layer's KV region, whose
// layout is [K|V][block][kv_head][slot_in_block][head_dim] (the host's KvLayout; the Rust
// function cuda::layout::slot_elem_offset is the same formula and is unit-tested against
// KvLayout::slot_offset).
__device__ __forceinline__ pd_i64 pd_slot_offset(int kind, pd_i64 block, int head, int slot,
                                                 int num_blocks, int kv_heads, int block_size,
                                                 int head_dim) {
    return (((pd_i64)kind * num_blocks + block) * kv_heads + head) * (pd_i64)block_size *
               head_dim +
           (pd_i64)slot * head_dim;
}
