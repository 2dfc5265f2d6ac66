// CPU reference for KDA's gate, q/k L2 norm and beta (fp32, elementwise / per row, parallel over tokens or rows).
#include "ops/kda_gate/kda_gate.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Rows per parallel chunk so each chunk has a few thousand elements.
int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_elems)); }

}  // namespace

void kda_gate_cpu(const KdaGateParams& p, const float* g_raw, const float* a_log, const float* dt_bias, float* g) {
  BG_CHECK(p.n_tokens >= 0, "kda_gate_cpu: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.head_dim > 0, "kda_gate_cpu: n_heads {} and head_dim {} must be positive", p.n_heads,
           p.head_dim);
  BG_CHECK(p.lower_bound < 0.0f, "kda_gate_cpu: lower_bound {} must be negative", p.lower_bound);
  if (p.n_tokens == 0) return;
  BG_CHECK(g_raw && a_log && dt_bias && g, "kda_gate_cpu: null pointer with n_tokens {}", p.n_tokens);
  const int64_t width = p.n_heads * p.head_dim;
  parallel_for(p.n_tokens, grain_for(width), [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      for (int64_t h = 0; h < p.n_heads; ++h) {
        const float a = std::exp(a_log[h]);  // per-head rate
        const int64_t base = h * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; ++d) {
          const int64_t i = t * width + base + d;
          g[i] = p.lower_bound * sigmoid(a * (g_raw[i] + dt_bias[base + d]));
        }
      }
    }
  });
}

void kda_l2norm_cpu(const KdaL2NormParams& p, const float* x, float* out) {
  BG_CHECK(p.n_rows >= 0, "kda_l2norm_cpu: n_rows {} is negative", p.n_rows);
  BG_CHECK(p.dim > 0, "kda_l2norm_cpu: dim {} must be positive", p.dim);
  BG_CHECK(p.eps > 0.0f, "kda_l2norm_cpu: eps {} must be positive", p.eps);
  if (p.n_rows == 0) return;
  BG_CHECK(x && out, "kda_l2norm_cpu: null pointer with n_rows {}", p.n_rows);
  parallel_for(p.n_rows, grain_for(p.dim), [&](int64_t r_begin, int64_t r_end) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* xr = x + r * p.dim;
      float* yr = out + r * p.dim;
      float ss = 0.0f;
      for (int64_t d = 0; d < p.dim; ++d) ss += xr[d] * xr[d];
      const float factor = p.scale / std::sqrt(ss + p.eps);
      for (int64_t d = 0; d < p.dim; ++d) yr[d] = xr[d] * factor;
    }
  });
}

void kda_beta_cpu(int64_t n, const float* b, float* beta) {
  BG_CHECK(n >= 0, "kda_beta_cpu: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(b && beta, "kda_beta_cpu: null pointer with n {}", n);
  for (int64_t i = 0; i < n; ++i) beta[i] = sigmoid(b[i]);
}

}  // namespace bg::ops
