// SiTU against the direct float64 formula, including pre-activations large enough that both tanh clamps saturate.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/situ/situ.h"

namespace bg::ops {
namespace {

double situ64(double g, double u, double beta, double beta_lin) {
  return beta * std::tanh(g / beta) / (1.0 + std::exp(-g)) * beta_lin * std::tanh(u / beta_lin);
}

TEST(Situ, MatchesFormulaOverWideRange) {
  const int64_t n_tokens = 6, n_inter = 200;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> gate(n_tokens * n_inter), up(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    // Scales from 0.1 to 300: |g| >> 4 saturates the gate clamp, |u| >> 25 the linear one.
    const float scale = std::pow(10.0f, -1.0f + 3.5f * static_cast<float>(i % 13) / 12.0f);
    gate[i] = scale * normal(rng);
    up[i] = scale * normal(rng);
  }
  gate[0] = -1000.0f;  // sigmoid underflows: exactly 0 contribution
  gate[1] = 1000.0f;   // act = beta
  up[1] = -1000.0f;    // lin = -beta_lin
  std::vector<float> out(gate.size());
  const SituParams p{n_tokens, n_inter, 4.0f, 25.0f};
  situ_cpu(p, gate.data(), up.data(), out.data());
  bool saw_gate_clamp = false, saw_lin_clamp = false;
  for (size_t i = 0; i < gate.size(); ++i) {
    const double expect = situ64(gate[i], up[i], 4.0, 25.0);
    EXPECT_NEAR(out[i], expect, 1e-6 * std::max(1.0, std::abs(expect))) << "gate " << gate[i] << " up " << up[i];
    saw_gate_clamp |= gate[i] > 20.0f;
    saw_lin_clamp |= std::abs(up[i]) > 100.0f;
  }
  EXPECT_TRUE(saw_gate_clamp && saw_lin_clamp);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_FLOAT_EQ(out[1], -100.0f);
  // Out in place over gate and over up.
  std::vector<float> over_gate = gate, over_up = up;
  situ_cpu(p, over_gate.data(), up.data(), over_gate.data());
  situ_cpu(p, gate.data(), over_up.data(), over_up.data());
  EXPECT_EQ(over_gate, out);
  EXPECT_EQ(over_up, out);
}

TEST(Situ, OtherBetas) {
  const std::vector<float> gate = {-7.0f, 0.3f, 12.0f}, up = {2.0f, -40.0f, 5.0f};
  std::vector<float> out(3);
  situ_cpu({1, 3, 2.0f, 10.0f}, gate.data(), up.data(), out.data());
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(out[i], situ64(gate[i], up[i], 2.0, 10.0), 1e-5);
}

TEST(Situ, RejectsBadParams) {
  std::vector<float> b(8);
  EXPECT_THROW(situ_cpu({-1, 2, 4.0f, 25.0f}, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(situ_cpu({1, 0, 4.0f, 25.0f}, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(situ_cpu({1, 2, 0.0f, 25.0f}, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(situ_cpu({1, 2, 4.0f, 25.0f}, b.data(), nullptr, b.data()), Error);
}

}  // namespace
}  // namespace bg::ops
