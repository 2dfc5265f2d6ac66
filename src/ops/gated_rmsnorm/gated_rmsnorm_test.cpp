// Gated per-head RMSNorm against the direct float64 formula.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"

namespace bg::ops {
namespace {

std::vector<float> random_vec(int64_t n, uint32_t seed, float mean, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

TEST(GatedRmsNorm, MatchesFormula) {
  for (int64_t head_dim : {1, 16, 128}) {
    const int64_t n_tokens = 5, n_heads = 3;
    const int64_t n = n_tokens * n_heads * head_dim;
    SCOPED_TRACE(testing::Message() << "D=" << head_dim);
    auto x = random_vec(n, 1, 0.0f, 3.0f);
    for (int64_t d = 0; d < head_dim; ++d) x[head_dim + d] *= 1e-4f;  // a tiny row where eps matters
    auto gate = random_vec(n, 2, 0.0f, 4.0f);
    gate[0] = -200.0f;  // sigmoid underflows to 0
    gate[1 % n] = 200.0f;
    const auto weight = random_vec(head_dim, 3, 1.0f, 0.3f);
    const GatedRmsNormParams p{n_tokens, n_heads, head_dim, 1e-5f};
    std::vector<float> y(n);
    gated_rmsnorm_cpu(p, x.data(), gate.data(), weight.data(), y.data());
    for (int64_t r = 0; r < n_tokens * n_heads; ++r) {
      double ss = 0.0;
      for (int64_t d = 0; d < head_dim; ++d) ss += double{x[r * head_dim + d]} * x[r * head_dim + d];
      const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(head_dim) + 1e-5);
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t i = r * head_dim + d;
        const double expect = x[i] * rstd * weight[d] / (1.0 + std::exp(-double{gate[i]}));
        EXPECT_NEAR(y[i], expect, 2e-6 * std::max(1.0, std::abs(expect)));
      }
    }
    // In place over x, and over gate.
    std::vector<float> over_x = x, over_gate = gate;
    gated_rmsnorm_cpu(p, over_x.data(), gate.data(), weight.data(), over_x.data());
    gated_rmsnorm_cpu(p, x.data(), over_gate.data(), weight.data(), over_gate.data());
    EXPECT_EQ(over_x, y);
    EXPECT_EQ(over_gate, y);
  }
}

TEST(GatedRmsNorm, RejectsBadParams) {
  std::vector<float> b(16);
  EXPECT_THROW(gated_rmsnorm_cpu({-1, 1, 4, 1e-5f}, b.data(), b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(gated_rmsnorm_cpu({1, 0, 4, 1e-5f}, b.data(), b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(gated_rmsnorm_cpu({1, 1, 4, 0.0f}, b.data(), b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(gated_rmsnorm_cpu({1, 1, 4, 1e-5f}, b.data(), nullptr, b.data(), b.data()), Error);
  gated_rmsnorm_cpu({0, 1, 4, 1e-5f}, nullptr, nullptr, nullptr, nullptr);
}

}  // namespace
}  // namespace bg::ops
