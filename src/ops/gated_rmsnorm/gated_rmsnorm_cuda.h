// CUDA gated per-head RMSNorm (KDA output norm): bf16 x and gate, fp32 weight and math, bf16 out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/gated_rmsnorm/gated_rmsnorm.h"

namespace bg::ops {

// y[t,h,:] = x[t,h,:] * rsqrt(mean_d(x[t,h,d]^2) + eps) * weight[:] * sigmoid(gate[t,h,:]).
//   x, gate, y [T, H, D] bf16 (y may equal x or gate); weight [D] fp32.
void gated_rmsnorm_cuda(const GatedRmsNormParams& p, const __nv_bfloat16* x, const __nv_bfloat16* gate,
                        const float* weight, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace bg::ops
