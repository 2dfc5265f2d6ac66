// Gated per-head RMSNorm (KDA output norm, fla FusedRMSNormGated with sigmoid): norm first, then the sigmoid gate.
#pragma once

#include <cstdint>

namespace bg::ops {

struct GatedRmsNormParams {
  int64_t n_tokens = 0;  // T, may be 0
  int64_t n_heads = 0;   // H
  int64_t head_dim = 0;  // D
  float eps = 1e-5f;     // rms_norm_eps
};

// y[t,h,:] = x[t,h,:] * rsqrt(mean_d(x[t,h,d]^2) + eps) * weight[:] * sigmoid(gate[t,h,:]).
//   x, gate, y [T, H, D] (y may alias x or gate); weight [D], shared by all heads (o_norm.weight).
void gated_rmsnorm_cpu(const GatedRmsNormParams& p, const float* x, const float* gate, const float* weight,
                       float* y);

}  // namespace bg::ops
