// CUDA gated per-head RMSNorm (KDA output norm): bf16 x and gate, fp32 weight and math, bf16 out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/gated_rmsnorm/gated_rmsnorm.h"

namespace bg::ops {

// y[t,h,:] = x[t,h,:] * rsqrt(mean_d(x[t,h,d]^2) + eps) * weight[:] * sigmoid(gate[t,h,:]).
//   x, gate, y [T, H, D] bf16 (y may equal x, or gate when packed); weight [D] fp32. gate_ld: elements from one token's
//   gate row to the next (0: H * D; more for a strided view of a wider buffer).
void gated_rmsnorm_cuda(const GatedRmsNormParams& p, const __nv_bfloat16* x, const __nv_bfloat16* gate,
                        const float* weight, __nv_bfloat16* y, cudaStream_t stream, int64_t gate_ld = 0);

}  // namespace bg::ops
