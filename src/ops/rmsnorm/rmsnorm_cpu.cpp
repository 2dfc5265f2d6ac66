// RMSNorm CPU reference (double accumulation of the sum of squares).
#include "ops/rmsnorm/rmsnorm.h"

#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {

void rmsnorm_cpu(const RmsNormParams& p, const float* x, const float* weight, float* y) {
  BG_CHECK(p.dim > 0 && p.n_rows >= 0, "rmsnorm: bad shape [{}, {}]", p.n_rows, p.dim);
  parallel_for(p.n_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * p.dim;
      float* yr = y + r * p.dim;
      double ss = 0.0;
      for (int64_t i = 0; i < p.dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(p.dim) + p.eps));
      for (int64_t i = 0; i < p.dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
    }
  });
}

}  // namespace bg::ops
