// Loopback dispatch/combine for one rank.
#include "moe/routed_experts.h"

#include <cstring>

#include "core/error.h"

namespace bg {

ExpertDispatch group_by_expert(const int32_t* expert_ids, const float* weights, int64_t n_tokens, int64_t top_k,
                               int64_t n_experts) {
  ExpertDispatch d;
  d.n_experts = n_experts;
  d.offsets.assign(static_cast<size_t>(n_experts + 1), 0);
  for (int64_t i = 0; i < n_tokens * top_k; ++i) {
    BG_CHECK(expert_ids[i] >= 0 && expert_ids[i] < n_experts, "routing chose expert {} of {}", expert_ids[i],
             n_experts);
    ++d.offsets[static_cast<size_t>(expert_ids[i]) + 1];
  }
  for (int64_t e = 0; e < n_experts; ++e) d.offsets[static_cast<size_t>(e + 1)] += d.offsets[static_cast<size_t>(e)];
  d.token_idx.resize(static_cast<size_t>(n_tokens * top_k));
  d.slot_weight.resize(static_cast<size_t>(n_tokens * top_k));
  std::vector<int64_t> cursor(d.offsets.begin(), d.offsets.end() - 1);
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      int64_t e = expert_ids[t * top_k + k];
      int64_t row = cursor[static_cast<size_t>(e)]++;
      d.token_idx[static_cast<size_t>(row)] = t;
      d.slot_weight[static_cast<size_t>(row)] = weights[t * top_k + k];
    }
  }
  return d;
}

void run_routed_experts_loopback(const ExpertDispatch& dispatch, const float* x, int64_t n_tokens, int64_t in_dim,
                                 int64_t out_dim, const ExpertFn& expert_fn, float* out) {
  (void)n_tokens;
  std::vector<float> in, y;
  for (int64_t e = 0; e < dispatch.n_experts; ++e) {
    int64_t begin = dispatch.offsets[static_cast<size_t>(e)], end = dispatch.offsets[static_cast<size_t>(e + 1)];
    int64_t n = end - begin;
    if (n == 0) continue;
    in.resize(static_cast<size_t>(n * in_dim));
    y.resize(static_cast<size_t>(n * out_dim));
    for (int64_t r = 0; r < n; ++r) {
      int64_t t = dispatch.token_idx[static_cast<size_t>(begin + r)];
      std::memcpy(in.data() + r * in_dim, x + t * in_dim, static_cast<size_t>(in_dim) * sizeof(float));
    }
    expert_fn(e, in.data(), n, y.data());
    for (int64_t r = 0; r < n; ++r) {
      int64_t t = dispatch.token_idx[static_cast<size_t>(begin + r)];
      float w = dispatch.slot_weight[static_cast<size_t>(begin + r)];
      for (int64_t i = 0; i < out_dim; ++i) out[t * out_dim + i] += w * y[static_cast<size_t>(r * out_dim + i)];
    }
  }
}

}  // namespace bg
