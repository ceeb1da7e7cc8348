// Sampling helpers on the device.
//
// argmax_rows: for each row of logits [rows, cols], the index of the largest value (the lowest
// index among equal values, as the host sampler's greedy path), that value, and the second
// largest value (the margin that tells how close a greedy choice was; -inf when cols == 1).
// Launch: grid (rows), block a multiple of 32 (launch.rs).

struct PdTop2 {
    float v1;
    int i1;
    float v2;
};

__device__ __forceinline__ PdTop2 pd_top2_merge(PdTop2 a, PdTop2 b) {
    PdTop2 r;
    if (b.v1 > a.v1 || (b.v1 == a.v1 && b.i1 < a.i1)) {
        r.v1 = b.v1;
        r.i1 = b.i1;
        r.v2 = fmaxf(a.v1, b.v2);
    } else {
        r.v1 = a.v1;
        r.i1 = a.i1;
        r.v2 = fmaxf(b.v1, a.v2);
    }
    return r;
}

extern "C" __global__ void argmax_rows(const float* logits, int cols, int* best_idx,
                                       float* best_val, float* second_val) {
    __shared__ PdTop2 warp_best[32];
    const int r = blockIdx.x;
    const float* row = logits + (pd_i64)r * cols;
    PdTop2 mine;
    mine.v1 = -PD_INF;
    mine.i1 = 0x7fffffff;
    mine.v2 = -PD_INF;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        PdTop2 one;
        one.v1 = row[c];
        one.i1 = c;
        one.v2 = -PD_INF;
        mine = pd_top2_merge(mine, one);
    }
    for (int o = 16; o > 0; o >>= 1) {
        PdTop2 other;
        other.v1 = __shfl_xor_sync(0xffffffffu, mine.v1, o);
        other.i1 = __shfl_xor_sync(0xffffffffu, mine.i1, o);
        other.v2 = __shfl_xor_sync(0xffffffffu, mine.v2, o);
        mine = pd_top2_merge(mine, other);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_best[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        PdTop2 all = warp_best[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) all = pd_top2_merge(all, warp_best[w]);
        best_idx[r] = all.i1;
        best_val[r] = all.v1;
        second_val[r] = all.v2;
    }
}
