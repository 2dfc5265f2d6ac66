// SwiGLU against the direct double formula silu(g) * u = g / (1 + e^-g) * u, out of place and in place over gate,
// including saturated gates.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/swiglu/swiglu.h"

namespace bg::ops {
namespace {

double swiglu64(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

TEST(Swiglu, MatchesFormula) {
  const int64_t n = 1000;
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> gate(n), up(n);
  for (size_t i = 0; i < gate.size(); ++i) {
    gate[i] = normal(rng) * static_cast<float>(1 + i % 10);  // up to |g| ~ 40: both tails of the sigmoid
    up[i] = normal(rng);
  }
  gate[0] = -1000.0f;  // e^-g overflows: silu -> -0
  gate[1] = 1000.0f;   // silu(g) = g
  gate[2] = 0.0f;
  std::vector<float> out(n, NAN);
  swiglu_cpu(gate.data(), up.data(), n, out.data());
  for (size_t i = 0; i < gate.size(); ++i) {
    double want = swiglu64(gate[i], up[i]);
    ASSERT_NEAR(out[i], want, 1e-6 * std::abs(want) + 1e-30) << "g " << gate[i] << " u " << up[i];
  }
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_FLOAT_EQ(out[1], 1000.0f * up[1]);
  EXPECT_EQ(out[2], 0.0f);
  // In place over gate.
  std::vector<float> in_place = gate;
  swiglu_cpu(in_place.data(), up.data(), n, in_place.data());
  EXPECT_EQ(in_place, out);
}

TEST(Swiglu, HandValues) {
  // silu(1) = 1 / (1 + e^-1) = 0.7310585786; silu(-2) = -2 / (1 + e^2) = -0.2384058440.
  const std::vector<float> gate = {1.0f, -2.0f, 3.0f}, up = {2.0f, -1.5f, 0.0f};
  std::vector<float> out(3);
  swiglu_cpu(gate.data(), up.data(), 3, out.data());
  EXPECT_NEAR(out[0], 1.4621171573, 1e-6);
  EXPECT_NEAR(out[1], 0.3576087660, 1e-6);
  EXPECT_EQ(out[2], 0.0f);
  swiglu_cpu(gate.data(), up.data(), 0, nullptr);  // n = 0 touches nothing
}

}  // namespace
}  // namespace bg::ops
