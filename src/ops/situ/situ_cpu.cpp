// CPU reference for SiTU (fp32, elementwise), parallel over tokens.
#include "ops/situ/situ.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {

void situ_cpu(const SituParams& p, const float* gate, const float* up, float* out) {
  BG_CHECK(p.n_tokens >= 0, "situ_cpu: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_inter > 0, "situ_cpu: n_inter {} must be positive", p.n_inter);
  BG_CHECK(p.beta > 0.0f && p.beta_lin > 0.0f, "situ_cpu: beta {} and beta_lin {} must be positive", p.beta,
           p.beta_lin);
  if (p.n_tokens == 0) return;
  BG_CHECK(gate && up && out, "situ_cpu: null pointer with n_tokens {}", p.n_tokens);
  const float inv_beta = 1.0f / p.beta;
  const float inv_beta_lin = 1.0f / p.beta_lin;
  parallel_for(p.n_tokens, std::max<int64_t>(1, 8192 / p.n_inter), [&](int64_t t_begin, int64_t t_end) {
    for (int64_t i = t_begin * p.n_inter; i < t_end * p.n_inter; ++i) {
      const float g = gate[i];
      // sigmoid(g) = 1 / (1 + exp(-g)): exp overflows to inf for g < -88, giving exactly 0, as it should.
      const float act = p.beta * std::tanh(g * inv_beta) / (1.0f + std::exp(-g));
      const float lin = p.beta_lin * std::tanh(up[i] * inv_beta_lin);
      out[i] = act * lin;
    }
  });
}

}  // namespace bg::ops
