// CPU reference for the Attention-Residual mix (fp32), parallel over tokens.
#include "ops/attn_res/attn_res.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {
namespace {

// Scores of every candidate for token t, turned into softmax weights in place. norm_proj [D] = norm * proj.
void token_weights(const AttnResParams& p, const float* const* values, const float* norm_proj, int64_t t,
                   float* alpha) {
  const int64_t dim = p.dim;
  const float inv_dim = 1.0f / static_cast<float>(dim);
  float max_score = -INFINITY;
  for (int64_t i = 0; i < p.n_candidates; ++i) {
    const float* vi = values[i] + t * dim;  // [D]
    float ss = 0.0f;
    float dot = 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
      ss += vi[d] * vi[d];
      dot += vi[d] * norm_proj[d];
    }
    // The rms factor is the same for every d, so it scales the dot product once.
    alpha[i] = dot / std::sqrt(ss * inv_dim + p.eps);
    max_score = std::max(max_score, alpha[i]);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < p.n_candidates; ++i) {
    alpha[i] = std::exp(alpha[i] - max_score);
    sum += alpha[i];
  }
  for (int64_t i = 0; i < p.n_candidates; ++i) alpha[i] /= sum;
}

}  // namespace

void attn_res_mix_cpu(const AttnResParams& p, const float* const* values, const float* norm, const float* proj,
                      float* out) {
  BG_CHECK(p.n_candidates > 0, "attn_res_mix_cpu: n_candidates {} must be positive", p.n_candidates);
  BG_CHECK(p.n_tokens >= 0, "attn_res_mix_cpu: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.dim > 0, "attn_res_mix_cpu: dim {} must be positive", p.dim);
  BG_CHECK(p.eps > 0.0f, "attn_res_mix_cpu: eps {} must be positive", p.eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(values && norm && proj && out, "attn_res_mix_cpu: null pointer with n_tokens {}", p.n_tokens);
  for (int64_t i = 0; i < p.n_candidates; ++i) BG_CHECK(values[i], "attn_res_mix_cpu: candidate {} is null", i);

  std::vector<float> norm_proj(p.dim);  // [D]
  for (int64_t d = 0; d < p.dim; ++d) norm_proj[d] = norm[d] * proj[d];
  parallel_for(p.n_tokens, std::max<int64_t>(1, 4096 / p.dim), [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> alpha(p.n_candidates);
    for (int64_t t = t_begin; t < t_end; ++t) {
      token_weights(p, values, norm_proj.data(), t, alpha.data());
      float* ot = out + t * p.dim;
      for (int64_t d = 0; d < p.dim; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < p.n_candidates; ++i) acc += alpha[i] * values[i][t * p.dim + d];
        ot[d] = acc;
      }
    }
  });
}

}  // namespace bg::ops
