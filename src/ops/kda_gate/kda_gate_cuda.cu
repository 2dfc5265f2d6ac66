// CUDA KDA gate and beta (grid-stride elementwise loops) and q/k L2 norm (the shared row-norm kernel).
#include "ops/kda_gate/kda_gate_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Element i of g: column c = i mod (H*K) belongs to head c / K.
__global__ void kda_gate_kernel(KdaGateParams p, const bf16* g_raw, const float* a_log, const float* dt_bias,
                                float* g) {
  const int64_t width = p.n_heads * p.head_dim;
  const int64_t n = p.n_tokens * width;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t c = i % width;
    const float a = expf(a_log[c / p.head_dim]);  // per-head rate
    g[i] = p.lower_bound * sigmoid(a * (cuda_util::to_f32(g_raw[i]) + dt_bias[c]));
  }
}

__global__ void kda_beta_kernel(int64_t n, const bf16* b, float* beta) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    beta[i] = sigmoid(cuda_util::to_f32(b[i]));
  }
}

// out = x * (scale / sqrt(ss + eps)), eps inside the sqrt as fla's l2norm.
struct L2NormOp {
  const bf16* x;
  bf16* out;
  int64_t dim;
  float scale, eps;

  struct Aux {};  // the epilogue reads nothing else
  __device__ float load(int64_t r, int64_t d) const { return cuda_util::to_f32(x[r * dim + d]); }
  __device__ Aux aux(int64_t, int64_t) const { return {}; }
  __device__ float factor(float ss) const { return scale / sqrtf(ss + eps); }
  __device__ void store(int64_t r, int64_t d, float v, float f, Aux) const {
    out[r * dim + d] = cuda_util::to_bf16(v * f);
  }
};

}  // namespace

void kda_gate_cuda(const KdaGateParams& p, const __nv_bfloat16* g_raw, const float* a_log, const float* dt_bias,
                   float* g, cudaStream_t stream) {
  BG_CHECK(p.n_tokens >= 0, "kda_gate_cuda: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.head_dim > 0, "kda_gate_cuda: n_heads {} and head_dim {} must be positive", p.n_heads,
           p.head_dim);
  BG_CHECK(p.lower_bound < 0.0f, "kda_gate_cuda: lower_bound {} must be negative", p.lower_bound);
  if (p.n_tokens == 0) return;
  BG_CHECK(g_raw && a_log && dt_bias && g, "kda_gate_cuda: null pointer with n_tokens {}", p.n_tokens);
  const int64_t n = p.n_tokens * p.n_heads * p.head_dim;
  kda_gate_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(p, g_raw, a_log, dt_bias, g);
  BG_CUDA_CHECK_LAUNCH();
}

void kda_l2norm_cuda(const KdaL2NormParams& p, const __nv_bfloat16* x, __nv_bfloat16* out, cudaStream_t stream) {
  BG_CHECK(p.n_rows >= 0 && p.n_rows < (int64_t{1} << 31), "kda_l2norm_cuda: bad n_rows {}", p.n_rows);
  BG_CHECK(p.dim > 0, "kda_l2norm_cuda: dim {} must be positive", p.dim);
  BG_CHECK(p.eps > 0.0f, "kda_l2norm_cuda: eps {} must be positive", p.eps);
  if (p.n_rows == 0) return;
  BG_CHECK(x && out, "kda_l2norm_cuda: null pointer with n_rows {}", p.n_rows);
  cuda_util::launch_row_norm(p.n_rows, p.dim, L2NormOp{x, out, p.dim, p.scale, p.eps}, stream);
  BG_CUDA_CHECK_LAUNCH();
}

void kda_beta_cuda(int64_t n, const __nv_bfloat16* b, float* beta, cudaStream_t stream) {
  BG_CHECK(n >= 0, "kda_beta_cuda: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(b && beta, "kda_beta_cuda: null pointer with n {}", n);
  kda_beta_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, b, beta);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops
