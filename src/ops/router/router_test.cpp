// MoE router: hand-built cases (bias for selection only, grouped selection, the 0.0 mask of losing groups, ties,
// order, renormalisation, scaling), a double-precision reference over random grids, and parameter checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/router/router.h"

namespace bg::ops {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed route(const RouterParams& p, const std::vector<float>& logits, const std::vector<float>* bias) {
  Routed r;
  r.ids.assign(static_cast<size_t>(p.n_tokens * p.top_k), -1);
  r.weights.assign(r.ids.size(), NAN);
  route_topk_cpu(p, logits.data(), bias ? bias->data() : nullptr, r.ids.data(), r.weights.data());
  return r;
}

// Reference for one token, written from reference.md: biased = s + b; group score = sum of the two largest biased
// scores; keep topk_group groups; losing groups get 0.0; top-k by (score desc, index asc); weights from s.
Routed reference_route(const RouterParams& p, const float* logits, const float* bias) {
  const int64_t per_group = p.n_experts / p.n_group;
  std::vector<double> s(static_cast<size_t>(p.n_experts)), b(s.size());
  for (int64_t e = 0; e < p.n_experts; ++e) {
    s[static_cast<size_t>(e)] = sigmoid(logits[e]);
    b[static_cast<size_t>(e)] = s[static_cast<size_t>(e)] + (bias ? bias[e] : 0.0);
  }
  if (p.n_group > 1) {
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < p.n_group; ++g) {
      std::vector<double> v(b.begin() + g * per_group, b.begin() + (g + 1) * per_group);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({v[0] + (per_group > 1 ? v[1] : 0.0), g});
    }
    std::stable_sort(groups.begin(), groups.end(), [](auto& x, auto& y) { return x.first > y.first; });
    for (size_t r = static_cast<size_t>(p.topk_group); r < groups.size(); ++r)
      for (int64_t i = 0; i < per_group; ++i) b[static_cast<size_t>(groups[r].second * per_group + i)] = 0.0;
  }
  std::vector<int64_t> order(static_cast<size_t>(p.n_experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return b[static_cast<size_t>(x)] > b[static_cast<size_t>(y)]; });
  Routed out;
  double sum = 0.0;
  for (int64_t k = 0; k < p.top_k; ++k) sum += s[static_cast<size_t>(order[static_cast<size_t>(k)])];
  for (int64_t k = 0; k < p.top_k; ++k) {
    int64_t e = order[static_cast<size_t>(k)];
    double w = s[static_cast<size_t>(e)];
    if (p.renormalize) w /= sum;
    out.ids.push_back(static_cast<int32_t>(e));
    out.weights.push_back(static_cast<float>(w * p.scaling_factor));
  }
  return out;
}

TEST(Router, SigmoidTopKWithoutBias) {
  RouterParams p{1, 8, 3, 1, 1, false, 1.0f};
  const std::vector<float> logits = {0.3f, -1.0f, 2.5f, 0.1f, 1.7f, -0.2f, 0.9f, -3.0f};
  Routed r = route(p, logits, nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 4, 6}));
  for (size_t k = 0; k < 3; ++k) EXPECT_NEAR(r.weights[k], sigmoid(logits[static_cast<size_t>(r.ids[k])]), 1e-7);
}

TEST(Router, BiasSelectsButWeightsAreUnbiased) {
  RouterParams p{1, 8, 3, 1, 1, false, 1.0f};
  const std::vector<float> logits = {0.3f, -1.0f, 2.5f, 0.1f, 1.7f, -0.2f, 0.9f, -3.0f};
  // Expert 7 (lowest score) is pushed to the top and expert 2 (highest) out of the top 3.
  const std::vector<float> bias = {0.0f, 0.0f, -0.6f, 0.0f, 0.0f, 0.0f, 0.0f, 1.5f};
  Routed r = route(p, logits, &bias);
  // biased: 7 -> 0.047 + 1.5 = 1.547, 4 -> 0.846, 6 -> 0.711, 2 -> 0.924 - 0.6 = 0.324.
  EXPECT_EQ(r.ids, (std::vector<int32_t>{7, 4, 6}));
  for (size_t k = 0; k < 3; ++k)
    EXPECT_NEAR(r.weights[k], sigmoid(logits[static_cast<size_t>(r.ids[k])]), 1e-7) << "k " << k;
  EXPECT_NEAR(r.weights[0], sigmoid(-3.0), 1e-7);  // not 1.547
}

TEST(Router, RenormalisationAndScaling) {
  const std::vector<float> logits = {0.3f, -1.0f, 2.5f, 0.1f, 1.7f, -0.2f, 0.9f, -3.0f};
  const double s2 = sigmoid(2.5), s4 = sigmoid(1.7), s6 = sigmoid(0.9), sum = s2 + s4 + s6;
  Routed plain = route({1, 8, 3, 1, 1, false, 2.5f}, logits, nullptr);
  Routed norm = route({1, 8, 3, 1, 1, true, 2.5f}, logits, nullptr);
  Routed norm1 = route({1, 8, 3, 1, 1, true, 1.0f}, logits, nullptr);
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{2, 4, 6}));
  EXPECT_EQ(norm.ids, plain.ids);
  const double s[3] = {s2, s4, s6};
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_NEAR(plain.weights[k], 2.5 * s[k], 1e-6);
    EXPECT_NEAR(norm.weights[k], 2.5 * s[k] / sum, 1e-6);
    EXPECT_NEAR(norm1.weights[k], s[k] / sum, 1e-6);
  }
  EXPECT_NEAR(norm.weights[0] + norm.weights[1] + norm.weights[2], 2.5, 1e-6);
}

TEST(Router, GroupedSelectionKeepsTheBestGroups) {
  // 16 experts in 4 groups of 4, keep 2 groups, pick 4. Group 0 holds the single largest score (expert 1, logit 6)
  // but its top-2 sum is small; groups 1 and 3 have the largest top-2 sums.
  RouterParams p{1, 16, 4, 4, 2, true, 1.0f};
  std::vector<float> logits(16, -4.0f);
  logits[1] = 6.0f;                      // group 0: 0.9975 + 0.018 = 1.016
  logits[4] = 2.0f, logits[6] = 1.5f;    // group 1: 0.881 + 0.818 = 1.699
  logits[9] = 1.0f, logits[10] = 1.0f;   // group 2: 0.731 + 0.731 = 1.462
  logits[12] = 3.0f, logits[15] = 1.2f;  // group 3: 0.953 + 0.769 = 1.721
  logits[13] = 1.1f;                     // group 3 third: does not count in the group score
  Routed r = route(p, logits, nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{12, 4, 6, 15}));
  for (int32_t id : r.ids) {
    EXPECT_NE(id, 1) << "the largest single score is in a losing group";
    EXPECT_TRUE(id / 4 == 1 || id / 4 == 3) << "expert " << id;
  }
  // Without grouping, expert 1 wins outright.
  Routed flat = route({1, 16, 4, 1, 1, true, 1.0f}, logits, nullptr);
  EXPECT_EQ(flat.ids[0], 1);
  // topk_group == n_group is no restriction either.
  Routed all = route({1, 16, 4, 4, 4, true, 1.0f}, logits, nullptr);
  EXPECT_EQ(all.ids, flat.ids);
  Routed ref = reference_route(p, logits.data(), nullptr);
  EXPECT_EQ(r.ids, ref.ids);
}

TEST(Router, LosingGroupsAreMaskedWithZeroNotMinusInfinity) {
  // transformers masks the losing groups with 0.0 (masked_fill(~mask, 0.0)), not -inf. The two differ only when
  // biased scores are negative: then a masked expert (0.0) outranks a negative expert of a kept group. We mirror
  // transformers. Targets are the biased scores; bias = target - sigmoid(logit).
  RouterParams p{1, 16, 6, 4, 2, false, 1.0f};
  const std::vector<float> target = {0.40f,  0.30f,  -0.40f, -0.42f,   // group 0: top-2 sum 0.70 (kept)
                                     0.35f,  0.25f,  -0.45f, -0.41f,   // group 1: 0.60 (kept)
                                     0.20f,  0.10f,  -0.30f, -0.30f,   // group 2: 0.30 (masked)
                                     -0.10f, -0.20f, -0.30f, -0.35f};  // group 3: -0.30 (masked)
  std::vector<float> logits(16), bias(16);
  for (size_t e = 0; e < 16; ++e) {
    logits[e] = 0.25f * static_cast<float>(e) - 2.0f;
    bias[e] = target[e] - static_cast<float>(sigmoid(logits[e]));
  }
  Routed r = route(p, logits, &bias);
  // The four positive kept experts, then 0.0 (masked, lowest index first: 8, 9) beats -0.40 (expert 2).
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 4, 1, 5, 8, 9}));
  for (size_t k = 0; k < 6; ++k)
    EXPECT_NEAR(r.weights[k], sigmoid(logits[static_cast<size_t>(r.ids[k])]), 1e-6) << "k " << k;
  // With a kept group's scores all positive, the mask cannot matter: top 4 are the kept experts.
  Routed four = route({1, 16, 4, 4, 2, false, 1.0f}, logits, &bias);
  EXPECT_EQ(four.ids, (std::vector<int32_t>{0, 4, 1, 5}));
}

TEST(Router, TiesGoToTheLowerIndex) {
  const std::vector<float> logits(12, 0.5f);
  Routed r = route({1, 12, 5, 1, 1, true, 1.0f}, logits, nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  for (float w : r.weights) EXPECT_NEAR(w, 0.2f, 1e-7);
  // Equal groups too: groups 0 and 1 win over 2 and 3 with identical scores everywhere.
  Routed g = route({1, 12, 3, 4, 2, true, 1.0f}, logits, nullptr);
  EXPECT_EQ(g.ids, (std::vector<int32_t>{0, 1, 2}));
  // A tie in the middle of distinct scores.
  const std::vector<float> mixed = {0.0f, 1.0f, 2.0f, 1.0f, 2.0f, -1.0f};
  Routed m = route({1, 6, 4, 1, 1, false, 1.0f}, mixed, nullptr);
  EXPECT_EQ(m.ids, (std::vector<int32_t>{2, 4, 1, 3}));
}

TEST(Router, MatchesReferenceOnRandomGrids) {
  struct Grid {
    int64_t n_experts, top_k, n_group, topk_group;
    bool renormalize;
    float scaling;
  };
  const Grid grids[] = {{64, 8, 8, 4, true, 2.5f}, {64, 6, 8, 3, false, 1.0f}, {48, 8, 1, 1, true, 2.827f},
                        {32, 4, 4, 1, true, 1.0f}, {24, 6, 6, 2, true, 1.5f},  {16, 16, 2, 1, false, 1.0f},
                        {20, 3, 5, 5, true, 1.0f}};
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::normal_distribution<float> small(0.0f, 0.3f);
  for (const Grid& g : grids) {
    for (bool negative_bias : {false, true}) {
      RouterParams p{5, g.n_experts, g.top_k, g.n_group, g.topk_group, g.renormalize, g.scaling};
      std::vector<float> logits(static_cast<size_t>(p.n_tokens * p.n_experts)), bias(static_cast<size_t>(g.n_experts));
      for (auto& x : logits) x = normal(rng);
      // Negative biases make some biased scores negative, where the 0.0 mask matters.
      for (auto& b : bias) b = small(rng) - (negative_bias ? 0.8f : 0.0f);
      Routed r = route(p, logits, &bias);
      for (int64_t t = 0; t < p.n_tokens; ++t) {
        Routed ref = reference_route(p, logits.data() + t * p.n_experts, bias.data());
        for (int64_t k = 0; k < p.top_k; ++k) {
          size_t i = static_cast<size_t>(t * p.top_k + k);
          ASSERT_EQ(r.ids[i], ref.ids[static_cast<size_t>(k)])
              << g.n_experts << "/" << g.n_group << " token " << t << " k " << k << " neg " << negative_bias;
          EXPECT_NEAR(r.weights[i], ref.weights[static_cast<size_t>(k)], 1e-6 * g.scaling);
        }
      }
    }
  }
}

TEST(Router, OutputsAreInDescendingBiasedScore) {
  RouterParams p{3, 32, 8, 4, 2, true, 1.0f};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(p.n_tokens * p.n_experts)), bias(32);
  for (auto& x : logits) x = normal(rng);
  for (auto& b : bias) b = 0.1f * normal(rng);
  Routed r = route(p, logits, &bias);
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t k = 1; k < p.top_k; ++k) {
      auto biased = [&](int64_t kk) {
        int32_t e = r.ids[static_cast<size_t>(t * p.top_k + kk)];
        return sigmoid(logits[static_cast<size_t>(t * p.n_experts + e)]) + bias[static_cast<size_t>(e)];
      };
      EXPECT_GE(biased(k - 1), biased(k)) << "token " << t << " k " << k;
    }
  }
}

TEST(Router, RejectsBadParams) {
  std::vector<float> logits(16, 0.0f);
  std::vector<int32_t> ids(16);
  std::vector<float> w(16);
  auto run = [&](RouterParams p) { route_topk_cpu(p, logits.data(), nullptr, ids.data(), w.data()); };
  EXPECT_THROW(run({1, 16, 0, 1, 1, true, 1.0f}), Error);   // top_k 0
  EXPECT_THROW(run({1, 16, 17, 1, 1, true, 1.0f}), Error);  // top_k > experts
  EXPECT_THROW(run({1, 0, 1, 1, 1, true, 1.0f}), Error);    // no experts
  EXPECT_THROW(run({1, 16, 4, 3, 1, true, 1.0f}), Error);   // 16 % 3 != 0
  EXPECT_THROW(run({1, 16, 4, 0, 1, true, 1.0f}), Error);   // no groups
  EXPECT_THROW(run({1, 16, 4, 4, 0, true, 1.0f}), Error);   // keep 0 groups
  EXPECT_THROW(run({1, 16, 4, 4, 5, true, 1.0f}), Error);   // keep more groups than exist
  EXPECT_NO_THROW(run({1, 16, 4, 4, 4, true, 1.0f}));
}

// NaN logits (a poisoned expert, a NaN hidden state) never become an invalid index: every id stays in range and
// distinct per token, finite scores still win, and the NaN reaches the weights (the engine fails the request there).
TEST(Router, NanScoresNeverBecomeInvalidIds) {
  const RouterParams p{3, 16, 4, 4, 2, true, 2.5f};
  std::vector<float> logits(static_cast<size_t>(3 * 16), 0.0f);
  for (int64_t e = 0; e < 16; ++e) logits[static_cast<size_t>(e)] = NAN;  // token 0: all NaN
  logits[static_cast<size_t>(16 + 3)] = NAN;                            // token 1: one NaN
  logits[static_cast<size_t>(16 + 7)] = 5.0f;
  for (int64_t e = 0; e < 16; ++e) logits[static_cast<size_t>(32 + e)] = 0.1f * static_cast<float>(e);  // token 2 clean
  const Routed r = route(p, logits, nullptr);
  for (int64_t t = 0; t < 3; ++t) {
    std::vector<int32_t> ids(r.ids.begin() + t * 4, r.ids.begin() + t * 4 + 4);
    for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 16) << "token " << t;
    std::sort(ids.begin(), ids.end());
    EXPECT_TRUE(std::adjacent_find(ids.begin(), ids.end()) == ids.end()) << "token " << t << ": repeated id";
  }
  EXPECT_TRUE(std::isnan(r.weights[0])) << "a NaN router row must not produce finite weights";
  EXPECT_EQ(r.ids[4], 7) << "the finite maximum still wins next to a NaN";
  for (size_t i = 8; i < 12; ++i) EXPECT_TRUE(std::isfinite(r.weights[i]));
}

}  // namespace
}  // namespace bg::ops
