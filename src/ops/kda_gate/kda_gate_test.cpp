// KDA gate, q/k L2 norm and beta against the direct float64 formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/kda_gate/kda_gate.h"

namespace bg::ops {
namespace {

std::vector<float> random_vec(int64_t n, uint32_t seed, float mean, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

double sigmoid64(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(KdaGate, LowerBoundGateMatchesFormula) {
  const int64_t n_tokens = 7, n_heads = 3, head_dim = 16;
  const auto g_raw = random_vec(n_tokens * n_heads * head_dim, 1, 0.0f, 3.0f);
  auto a_log = random_vec(head_dim, 2, 0.0f, 1.0f);  // stored [K]; entries beyond H must not matter
  for (int64_t i = n_heads; i < head_dim; ++i) a_log[i] = NAN;
  const auto dt_bias = random_vec(n_heads * head_dim, 3, 0.0f, 1.0f);
  std::vector<float> g(g_raw.size());
  const KdaGateParams p{n_tokens, n_heads, head_dim, -5.0f};
  kda_gate_cpu(p, g_raw.data(), a_log.data(), dt_bias.data(), g.data());
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < n_heads; ++h) {
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t i = (t * n_heads + h) * head_dim + d;
        const double x = std::exp(static_cast<double>(a_log[h])) * (g_raw[i] + double{dt_bias[h * head_dim + d]});
        const double expect = -5.0 * sigmoid64(x);
        EXPECT_NEAR(g[i], expect, 1e-6 * 5.0);
        EXPECT_LE(g[i], 0.0f);
        EXPECT_GE(g[i], -5.0f);
      }
    }
  }
  // In place.
  std::vector<float> inplace = g_raw;
  kda_gate_cpu(p, inplace.data(), a_log.data(), dt_bias.data(), inplace.data());
  EXPECT_EQ(inplace, g);
}

TEST(KdaGate, L2NormMatchesFormula) {
  const int64_t n_rows = 9, dim = 32;
  auto x = random_vec(n_rows * dim, 4, 0.0f, 2.0f);
  for (int64_t d = 0; d < dim; ++d) x[d] = 0.0f;           // an all-zero row stays zero (eps keeps it finite)
  for (int64_t d = 0; d < dim; ++d) x[dim + d] *= 1e-4f;  // a tiny row where eps decides the result
  for (float scale : {1.0f, 1.0f / std::sqrt(32.0f)}) {
    std::vector<float> y(x.size());
    kda_l2norm_cpu({n_rows, dim, scale, 1e-6f}, x.data(), y.data());
    for (int64_t r = 0; r < n_rows; ++r) {
      double ss = 0.0;
      for (int64_t d = 0; d < dim; ++d) ss += double{x[r * dim + d]} * x[r * dim + d];
      for (int64_t d = 0; d < dim; ++d) {
        const double expect = scale * x[r * dim + d] / std::sqrt(ss + 1e-6);
        EXPECT_NEAR(y[r * dim + d], expect, 1e-6 * std::max(1.0, std::abs(expect)));
      }
    }
    std::vector<float> inplace = x;
    kda_l2norm_cpu({n_rows, dim, scale, 1e-6f}, inplace.data(), inplace.data());
    EXPECT_EQ(inplace, y);
  }
}

TEST(KdaGate, BetaIsSigmoid) {
  const std::vector<float> b = {-100.0f, -3.0f, 0.0f, 0.5f, 20.0f, 100.0f};
  std::vector<float> beta(b.size());
  kda_beta_cpu(static_cast<int64_t>(b.size()), b.data(), beta.data());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(beta[i], sigmoid64(b[i]), 1e-7);
  kda_beta_cpu(0, nullptr, nullptr);
}

TEST(KdaGate, RejectsBadParams) {
  std::vector<float> x(64);
  EXPECT_THROW(kda_gate_cpu({1, 0, 4, -5.0f}, x.data(), x.data(), x.data(), x.data()), Error);
  EXPECT_THROW(kda_gate_cpu({1, 1, 4, 0.0f}, x.data(), x.data(), x.data(), x.data()), Error);
  EXPECT_THROW(kda_gate_cpu({1, 1, 4, -5.0f}, x.data(), nullptr, x.data(), x.data()), Error);
  EXPECT_THROW(kda_l2norm_cpu({1, 0, 1.0f, 1e-6f}, x.data(), x.data()), Error);
  EXPECT_THROW(kda_l2norm_cpu({-1, 4, 1.0f, 1e-6f}, x.data(), x.data()), Error);
  EXPECT_THROW(kda_beta_cpu(-1, x.data(), x.data()), Error);
}

}  // namespace
}  // namespace bg::ops
