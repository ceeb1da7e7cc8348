// Element-wise kernels of the forward pass.
//
// embedding_*: rows of this rank's vocabulary slice of the embedding table (in the weight
//   type) for each token, as f32; tokens outside the slice get zero rows (the ranks' rows are
//   then summed by the all-reduce, as on CPU). Launch: grid (tokens), block multiple of 32.
// silu_mul_*: SwiGLU on the fused gate|up rows: out[r, j] = silu(gate) * up, written in the
//   matmul input type. Launch: 1-D over rows * ffn (launch.rs).
// add_inplace: x += y (residual). bias_add: y[r, c] += b[c]. Launch: 1-D.
// scatter_rows: rows[r, :] replace x[at[r], :] (a vision-language prompt's image rows at their
//   placeholder tokens, after the embedding's all-reduce). Launch: grid (n), block multiple
//   of 32.

template <typename T>
__device__ __forceinline__ void embedding_impl(const T* table, const unsigned int* tokens,
                                               unsigned int vocab_start,
                                               unsigned int vocab_len, int d, float* out) {
    const int t = blockIdx.x;
    const unsigned int id = tokens[t] - vocab_start;
    float* o = out + (pd_i64)t * d;
    if (id < vocab_len) {
        const T* row = table + (pd_i64)id * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = pd_load(row + i);
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = 0.0f;
    }
}

#define PD_EMBEDDING(NAME, T)                                                                 \
    extern "C" __global__ void NAME(const T* table, const unsigned int* tokens,               \
                                    unsigned int vocab_start, unsigned int vocab_len, int d,  \
                                    float* out) {                                             \
        embedding_impl<T>(table, tokens, vocab_start, vocab_len, d, out);                     \
    }

PD_EMBEDDING(embedding_f32, float)
PD_EMBEDDING(embedding_f16, pd_f16)
PD_EMBEDDING(embedding_bf16, pd_bf16)

template <typename T>
__device__ __forceinline__ void silu_mul_impl(const float* gate_up, pd_i64 rows, int ffn,
                                              T* out) {
    const pd_i64 n = rows * ffn;
    for (pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (pd_i64)gridDim.x * blockDim.x) {
        const pd_i64 r = i / ffn;
        const int j = (int)(i % ffn);
        const float g = gate_up[r * 2 * ffn + j];
        const float u = gate_up[r * 2 * ffn + ffn + j];
        pd_store(out + i, __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
    }
}

#define PD_SILU_MUL(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const float* gate_up, pd_i64 rows, int ffn, T* out) {     \
        silu_mul_impl<T>(gate_up, rows, ffn, out);                                            \
    }

PD_SILU_MUL(silu_mul_f32, float)
PD_SILU_MUL(silu_mul_f16, pd_f16)
PD_SILU_MUL(silu_mul_bf16, pd_bf16)

extern "C" __global__ void add_inplace(float* x, const float* y, pd_i64 n) {
    for (pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (pd_i64)gridDim.x * blockDim.x) {
        x[i] = __fadd_rn(x[i], y[i]);
    }
}

extern "C" __global__ void bias_add(float* y, const float* b, pd_i64 rows, int cols) {
    const pd_i64 n = rows * cols;
    for (pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (pd_i64)gridDim.x * blockDim.x) {
        y[i] = __fadd_rn(y[i], b[i % cols]);
    }
}

extern "C" __global__ void scatter_rows(const float* rows, const int* at, int n, int d,
                                        float* x) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const float* src = rows + (pd_i64)r * d;
    float* dst = x + (pd_i64)at[r] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}
