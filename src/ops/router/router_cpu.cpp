// Router CPU reference. Masked groups get score 0.0 (not -inf), as transformers does, so a selection can only differ
// from a -inf mask when biased scores are negative; ties break toward the lower expert index. A NaN score selects as
// the lowest finite value (never breaking the sort's ordering); its NaN weight then reaches the logits, where the
// engine's per-step check fails the request.
#include "ops/router/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace bg::ops {

void route_topk_cpu(const RouterParams& p, const float* logits, const float* bias, int32_t* expert_ids,
                    float* weights) {
  BG_CHECK(p.n_experts > 0 && p.top_k > 0 && p.top_k <= p.n_experts, "router: top_k {} of {} experts", p.top_k,
           p.n_experts);
  BG_CHECK(p.n_group > 0 && p.n_experts % p.n_group == 0 && p.topk_group >= 1 && p.topk_group <= p.n_group,
           "router: {} experts in {} groups, keep {}", p.n_experts, p.n_group, p.topk_group);
  const int64_t per_group = p.n_experts / p.n_group;
  std::vector<float> scores(static_cast<size_t>(p.n_experts)), choice(static_cast<size_t>(p.n_experts));
  std::vector<int64_t> order(static_cast<size_t>(std::max(p.n_experts, p.n_group)));
  std::vector<float> group_score(static_cast<size_t>(p.n_group));
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t e = 0; e < p.n_experts; ++e) {
      float s = 1.0f / (1.0f + std::exp(-logits[t * p.n_experts + e]));
      scores[static_cast<size_t>(e)] = s;
      const float c = s + (bias ? bias[e] : 0.0f);
      choice[static_cast<size_t>(e)] = std::isnan(c) ? -std::numeric_limits<float>::max() : c;
    }
    if (p.n_group > 1 && p.topk_group < p.n_group) {
      for (int64_t g = 0; g < p.n_group; ++g) {
        float* c = choice.data() + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t i = 0; i < per_group; ++i) {
          if (c[i] > best) {
            second = best;
            best = c[i];
          } else if (c[i] > second) {
            second = c[i];
          }
        }
        group_score[static_cast<size_t>(g)] = per_group >= 2 ? best + second : best;
      }
      std::iota(order.begin(), order.begin() + p.n_group, 0);
      std::stable_sort(order.begin(), order.begin() + p.n_group,
                       [&](int64_t a, int64_t b) { return group_score[static_cast<size_t>(a)] >
                                                          group_score[static_cast<size_t>(b)]; });
      for (int64_t r = p.topk_group; r < p.n_group; ++r) {
        int64_t g = order[static_cast<size_t>(r)];
        std::fill(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group, 0.0f);
      }
    }
    std::iota(order.begin(), order.begin() + p.n_experts, 0);
    std::partial_sort(order.begin(), order.begin() + p.top_k, order.begin() + p.n_experts, [&](int64_t a, int64_t b) {
      float ca = choice[static_cast<size_t>(a)], cb = choice[static_cast<size_t>(b)];
      return ca != cb ? ca > cb : a < b;
    });
    float sum = 0.0f;
    for (int64_t k = 0; k < p.top_k; ++k) sum += scores[static_cast<size_t>(order[static_cast<size_t>(k)])];
    for (int64_t k = 0; k < p.top_k; ++k) {
      int64_t e = order[static_cast<size_t>(k)];
      float w = scores[static_cast<size_t>(e)];
      if (p.renormalize) w /= (sum + 1e-20f);
      expert_ids[t * p.top_k + k] = static_cast<int32_t>(e);
      weights[t * p.top_k + k] = w * p.scaling_factor;
    }
  }
}

}  // namespace bg::ops
