// RMSNorm over the last dim: y = w * x * rsqrt(mean(x^2) + eps), fp32.
#pragma once

#include <cstdint>

namespace bg::ops {

struct RmsNormParams {
  int64_t n_rows = 0;  // tokens (or tokens x heads for per-head norms)
  int64_t dim = 0;
  float eps = 1e-6f;
};

// x, y: [n_rows, dim] (may alias); weight: [dim].
void rmsnorm_cpu(const RmsNormParams& p, const float* x, const float* weight, float* y);

}  // namespace bg::ops
