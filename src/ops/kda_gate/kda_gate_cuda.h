// CUDA KDA pre-processing: the lower-bound forget gate and beta (bf16 in, fp32 out) and the per-head q/k L2 norm
// (bf16 in and out); same params as the CPU references.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/kda_gate/kda_gate.h"

namespace bg::ops {

// g[t,h,d] = lower_bound * sigmoid(exp(a_log[h]) * (g_raw[t,h*K+d] + dt_bias[h*K+d])).
//   g_raw [T, H*K] bf16; a_log [>= H] fp32; dt_bias [H*K] fp32; g [T, H, K] fp32 (a separate buffer).
void kda_gate_cuda(const KdaGateParams& p, const __nv_bfloat16* g_raw, const float* a_log, const float* dt_bias,
                   float* g, cudaStream_t stream);

// out[r,:] = scale * x[r,:] / sqrt(sum_d x[r,d]^2 + eps). x, out: [n_rows, dim] bf16 (may be equal).
void kda_l2norm_cuda(const KdaL2NormParams& p, const __nv_bfloat16* x, __nv_bfloat16* out, cudaStream_t stream);

// beta[i] = sigmoid(b[i]) for i < n. b bf16, beta fp32.
void kda_beta_cuda(int64_t n, const __nv_bfloat16* b, float* beta, cudaStream_t stream);

}  // namespace bg::ops
