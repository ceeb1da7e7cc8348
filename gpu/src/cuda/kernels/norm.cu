// RMSNorm over rows of the f32 residual stream, writing the normalized rows in the matmul
// input type (f32, f16 or bf16).
//
//   out[r] = x[row] / sqrt(mean(x[row]^2) + eps) * w        row = rows ? rows[r] : r
//
// With `delta` set, the residual add is fused in front: x[row] += delta[row] is written back
// first and the sum is normalized. Products are rounded one by one (no fused multiply-add), as
// the CPU backend computes them. Launch: grid (rows), block a multiple of 32 (launch.rs).

template <typename T>
__device__ __forceinline__ void rms_norm_impl(float* x, const float* delta, const int* rows,
                                              const float* w, float eps, int d, T* out) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const pd_i64 src = (pd_i64)(rows ? rows[r] : r) * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = x[src + i];
        if (delta) {
            v = __fadd_rn(v, delta[src + i]);
            x[src + i] = v;
        }
        ss += v * v;
    }
    ss = pd_block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)d + eps);
    T* o = out + (pd_i64)r * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        pd_store(o + i, __fmul_rn(__fmul_rn(x[src + i], scale), w[i]));
    }
}

#define PD_RMS_NORM(NAME, T)                                                                  \
    extern "C" __global__ void NAME(float* x, const float* delta, const int* rows,            \
                                    const float* w, float eps, int d, T* out) {               \
        rms_norm_impl<T>(x, delta, rows, w, eps, d, out);                                     \
    }

PD_RMS_NORM(rms_norm_f32, float)
PD_RMS_NORM(rms_norm_f16, pd_f16)
PD_RMS_NORM(rms_norm_bf16, pd_bf16)
