// CPU reference for the gated per-head RMSNorm (fp32), parallel over (token, head) rows.
#include "ops/gated_rmsnorm/gated_rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {

void gated_rmsnorm_cpu(const GatedRmsNormParams& p, const float* x, const float* gate, const float* weight,
                       float* y) {
  BG_CHECK(p.n_tokens >= 0, "gated_rmsnorm_cpu: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.head_dim > 0, "gated_rmsnorm_cpu: n_heads {} and head_dim {} must be positive",
           p.n_heads, p.head_dim);
  BG_CHECK(p.eps > 0.0f, "gated_rmsnorm_cpu: eps {} must be positive", p.eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(x && gate && weight && y, "gated_rmsnorm_cpu: null pointer with n_tokens {}", p.n_tokens);
  const int64_t n_rows = p.n_tokens * p.n_heads;
  const int64_t dim = p.head_dim;
  const float inv_dim = 1.0f / static_cast<float>(dim);
  parallel_for(n_rows, std::max<int64_t>(1, 8192 / dim), [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* xr = x + r * dim;  // [D]
      const float* gr = gate + r * dim;
      float* yr = y + r * dim;
      float ss = 0.0f;
      for (int64_t d = 0; d < dim; ++d) ss += xr[d] * xr[d];
      const float rstd = 1.0f / std::sqrt(ss * inv_dim + p.eps);
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = xr[d] * rstd * weight[d];
        yr[d] = normed / (1.0f + std::exp(-gr[d]));
      }
    }
  });
}

}  // namespace bg::ops
