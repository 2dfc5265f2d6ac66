// CUDA RMSNorm over bf16 rows with an fp32 weight: fp32 sum of squares and math, bf16 out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/rmsnorm/rmsnorm.h"

namespace bg::ops {

// Elements between consecutive rows; 0 means dim (contiguous). Lets a norm run over a slice of a wider row (the first
// kv_lora_rank values of MLA's [n, 576] latent, say).
struct RmsNormStrides {
  int64_t x_row = 0;
  int64_t y_row = 0;
};

// y[r, :] = weight * x[r, :] * rsqrt(mean(x[r, :]^2) + eps). x, y: [n_rows, dim] at their row strides; weight: [dim].
// y may equal x (in place) when both strides are equal.
void rmsnorm_cuda(const RmsNormParams& p, const RmsNormStrides& strides, const __nv_bfloat16* x, const float* weight,
                  __nv_bfloat16* y, cudaStream_t stream);
// Contiguous rows.
void rmsnorm_cuda(const RmsNormParams& p, const __nv_bfloat16* x, const float* weight, __nv_bfloat16* y,
                  cudaStream_t stream);

}  // namespace bg::ops
