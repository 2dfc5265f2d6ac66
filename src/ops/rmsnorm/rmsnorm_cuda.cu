// CUDA RMSNorm: the shared row-norm kernel (a warp per row up to dim 1024, else a block per row) with the RMS epilogue.
#include "ops/rmsnorm/rmsnorm_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

// y = w * (x * inv), inv = 1 / sqrt(ss / dim + eps): the CPU reference's order of operations.
struct RmsNormOp {
  const bf16* x;
  bf16* y;
  const float* weight;
  int64_t x_row, y_row;
  float inv_dim, eps;

  using Aux = float;  // weight[d]
  __device__ float load(int64_t r, int64_t d) const { return cuda_util::to_f32(x[r * x_row + d]); }
  __device__ float aux(int64_t, int64_t d) const { return weight[d]; }
  __device__ float factor(float ss) const { return 1.0f / sqrtf(ss * inv_dim + eps); }
  __device__ void store(int64_t r, int64_t d, float v, float inv, float w) const {
    y[r * y_row + d] = cuda_util::to_bf16(w * (v * inv));
  }
};

}  // namespace

void rmsnorm_cuda(const RmsNormParams& p, const RmsNormStrides& strides, const __nv_bfloat16* x, const float* weight,
                  __nv_bfloat16* y, cudaStream_t stream) {
  BG_CHECK(p.dim > 0 && p.n_rows >= 0, "rmsnorm_cuda: bad shape [{}, {}]", p.n_rows, p.dim);
  BG_CHECK(p.n_rows < (int64_t{1} << 31), "rmsnorm_cuda: {} rows exceed the grid", p.n_rows);
  const int64_t x_row = strides.x_row == 0 ? p.dim : strides.x_row;
  const int64_t y_row = strides.y_row == 0 ? p.dim : strides.y_row;
  BG_CHECK(x_row >= p.dim && y_row >= p.dim, "rmsnorm_cuda: row strides x {} y {} below dim {}", x_row, y_row,
           p.dim);
  BG_CHECK(x != y || x_row == y_row, "rmsnorm_cuda: in place needs equal strides, got x {} y {}", x_row, y_row);
  if (p.n_rows == 0) return;
  BG_CHECK(x && weight && y, "rmsnorm_cuda: null pointer with {} rows", p.n_rows);
  const RmsNormOp op{x, y, weight, x_row, y_row, 1.0f / static_cast<float>(p.dim), p.eps};
  cuda_util::launch_row_norm(p.n_rows, p.dim, op, stream);
  BG_CUDA_CHECK_LAUNCH();
}

void rmsnorm_cuda(const RmsNormParams& p, const __nv_bfloat16* x, const float* weight, __nv_bfloat16* y,
                  cudaStream_t stream) {
  rmsnorm_cuda(p, RmsNormStrides{}, x, weight, y, stream);
}

}  // namespace bg::ops
