// CUDA gated RMSNorm: the shared row-norm kernel over T*H rows of head_dim, with the gated epilogue.
#include "ops/gated_rmsnorm/gated_rmsnorm_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

// y = (x * rstd * w) / (1 + exp(-g)): the CPU reference's order of operations.
struct GatedNormOp {
  const bf16* x;
  const bf16* gate;
  bf16* y;
  const float* weight;
  int64_t dim, heads, gate_ld;  // a row r is head r % heads of token r / heads
  float inv_dim, eps;

  struct Aux {
    float w, g;  // weight[d], gate[r, d]
  };
  __device__ float load(int64_t r, int64_t d) const { return cuda_util::to_f32(x[r * dim + d]); }
  __device__ Aux aux(int64_t r, int64_t d) const {
    return {weight[d], cuda_util::to_f32(gate[(r / heads) * gate_ld + (r % heads) * dim + d])};
  }
  __device__ float factor(float ss) const { return 1.0f / sqrtf(ss * inv_dim + eps); }
  __device__ void store(int64_t r, int64_t d, float v, float rstd, Aux a) const {
    const float normed = v * rstd * a.w;
    y[r * dim + d] = cuda_util::to_bf16(normed / (1.0f + expf(-a.g)));
  }
};

}  // namespace

void gated_rmsnorm_cuda(const GatedRmsNormParams& p, const __nv_bfloat16* x, const __nv_bfloat16* gate,
                        const float* weight, __nv_bfloat16* y, cudaStream_t stream, int64_t gate_ld) {
  BG_CHECK(p.n_tokens >= 0, "gated_rmsnorm_cuda: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.head_dim > 0, "gated_rmsnorm_cuda: n_heads {} and head_dim {} must be positive",
           p.n_heads, p.head_dim);
  BG_CHECK(p.eps > 0.0f, "gated_rmsnorm_cuda: eps {} must be positive", p.eps);
  const int64_t n_rows = p.n_tokens * p.n_heads;
  BG_CHECK(n_rows < (int64_t{1} << 31), "gated_rmsnorm_cuda: {} rows exceed the grid", n_rows);
  if (n_rows == 0) return;
  BG_CHECK(x && gate && weight && y, "gated_rmsnorm_cuda: null pointer with n_tokens {}", p.n_tokens);
  const int64_t width = p.n_heads * p.head_dim;
  if (gate_ld == 0) gate_ld = width;
  BG_CHECK(gate_ld >= width && (gate_ld == width || y != gate),
           "gated_rmsnorm_cuda: gate rows {} elements apart for {} values a token (y may alias a packed gate only)",
           gate_ld, width);
  const float inv_dim = 1.0f / static_cast<float>(p.head_dim);
  const GatedNormOp op{x, gate, y, weight, p.head_dim, p.n_heads, gate_ld, inv_dim, p.eps};
  cuda_util::launch_row_norm(n_rows, p.head_dim, op, stream);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops
